-- The results' latency histogram buckets per model (rolled up + the tail).
WITH
--! include finished_tail
SELECT u.model, u.metric, u.le_ms, sum(u.n) AS n, sum(u.sum_ms) AS sum_ms,
       (SELECT now_at FROM watermark) AS watermark
FROM (
    SELECT model, metric, le_ms, n, sum_ms FROM latency_totals
    UNION ALL
--! include latency_rows
) AS u
GROUP BY u.model, u.metric, u.le_ms
