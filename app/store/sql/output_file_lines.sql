-- The lines of batch :batch_id's output file (:statuses succeeded) or error file (the
-- other ended statuses), in input order (store.files.output_chunks reads them through a
-- server-side cursor).
SELECT
--! include output_line
    AS line
FROM items AS i
LEFT JOIN results AS r ON r.item_id = i.id AND i.status = 'succeeded'
WHERE i.batch_id = :batch_id AND i.status = ANY(:statuses)
ORDER BY i.line_no
