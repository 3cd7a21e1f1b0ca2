-- The size in bytes of batch :batch_id's output or error file (:statuses), counted from
-- its lines: for a batch rolled up before the sizes were (store.files.describe_output).
SELECT coalesce(sum(octet_length(
--! include output_line
    )), 0) AS bytes
FROM items AS i
LEFT JOIN results AS r ON r.item_id = i.id AND i.status = 'succeeded'
WHERE i.batch_id = :batch_id AND i.status = ANY(:statuses)
