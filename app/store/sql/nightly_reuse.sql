-- The products of a run (:product_ids and :sha256s, in catalog order) that it serves
-- from their stored text: those whose stored description was made from the same
-- request (the same SHA-256). The text is copied with the product's place in the
-- catalog, so a later run's result does not change this run's output. LATERAL with
-- LIMIT (which keeps it from being merged into a join): one primary-key lookup per
-- product, whatever the planner believes of the table's size.
INSERT INTO nightly_reused
    (tenant_id, job, run_date, product_id, position, request_sha256, description)
SELECT :tenant_id, :job, :run_date, r.product_id, CAST(r.position AS integer),
       p.request_sha256, p.description
FROM unnest(CAST(:product_ids AS text[]), CAST(:sha256s AS text[]))
     WITH ORDINALITY AS r (product_id, sha256, position)
CROSS JOIN LATERAL (
    SELECT request_sha256, description
    FROM nightly_products
    WHERE tenant_id = :tenant_id AND job = :job AND product_id = r.product_id
    LIMIT 1
) AS p
WHERE p.request_sha256 = r.sha256 AND p.description IS NOT NULL
RETURNING product_id, request_sha256
