-- Batch :batch_id's finished items and the bytes of their file lines per status, rolled
-- up + the tail (store.totals.batch_files); bytes NULL when a part of them was rolled up
-- before the sizes were counted.
WITH
--! include finished_tail
SELECT u.status, sum(u.items) AS items,
       CASE WHEN bool_and(u.bytes IS NOT NULL) THEN sum(u.bytes) END AS bytes,
       (SELECT now_at FROM watermark) AS watermark
FROM (
    SELECT status, items, bytes FROM batch_totals WHERE batch_id = :batch_id
    UNION ALL
    SELECT i.status, 1, octet_length(
--! include output_line
    )
    FROM ended AS e
    JOIN items AS i ON i.id = e.id
    LEFT JOIN results AS r ON r.item_id = i.id AND i.status = 'succeeded'
    WHERE e.batch_id = :batch_id
) AS u
GROUP BY u.status
