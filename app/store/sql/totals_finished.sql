-- Finished items per model, tenant and status (rolled up + the tail), in one snapshot.
WITH
--! include finished_tail
SELECT u.model, u.tenant_id, u.status, sum(u.items) AS items, sum(u.tokens_est) AS tokens_est,
       (SELECT now_at FROM watermark) AS watermark
FROM (
    SELECT model, tenant_id, status, items, tokens_est FROM finished_totals
    UNION ALL
    SELECT model, tenant_id, status, count(*), sum(tokens_est)
    FROM ended
    GROUP BY model, tenant_id, status
) AS u
GROUP BY u.model, u.tenant_id, u.status
