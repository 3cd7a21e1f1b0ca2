-- The requests a run submits: each product's pending request and the run's date. A
-- product that a later run has already submitted keeps that run's (an earlier date
-- submitted again must not take over its result).
INSERT INTO nightly_products AS p (tenant_id, job, product_id, pending_sha256, pending_on)
SELECT :tenant_id, :job, r.product_id, r.sha256, :run_date
FROM unnest(CAST(:product_ids AS text[]), CAST(:sha256s AS text[])) AS r (product_id, sha256)
ON CONFLICT (tenant_id, job, product_id) DO UPDATE
SET pending_sha256 = excluded.pending_sha256, pending_on = excluded.pending_on
WHERE p.pending_on IS NULL OR p.pending_on <= excluded.pending_on
