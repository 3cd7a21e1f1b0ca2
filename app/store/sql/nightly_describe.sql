-- A run's results: each product whose pending request is still this run's gets the
-- text and the request it was made from (a product a later run submitted meanwhile
-- waits for that run's). The = ANY bounds the work by the results given, not by the
-- job's products, whatever plan is chosen.
UPDATE nightly_products AS p
SET request_sha256 = p.pending_sha256, description = r.description, described_on = p.pending_on
FROM unnest(CAST(:product_ids AS text[]), CAST(:descriptions AS text[]))
     AS r (product_id, description)
WHERE p.tenant_id = :tenant_id AND p.job = :job
  AND p.product_id = ANY(CAST(:product_ids AS text[]))
  AND p.product_id = r.product_id AND p.pending_on = :run_date
