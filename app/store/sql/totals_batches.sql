-- Finished items per status of the given batches (rolled up + the tail).
WITH
--! include finished_tail
SELECT u.batch_id, u.status, sum(u.items) AS items, (SELECT now_at FROM watermark) AS watermark
FROM (
    SELECT batch_id, status, items FROM batch_totals WHERE batch_id = ANY(:batch_ids)
    UNION ALL
    SELECT batch_id, status, count(*) FROM ended
    WHERE batch_id = ANY(:batch_ids)
    GROUP BY batch_id, status
) AS u
GROUP BY u.batch_id, u.status
