-- Open items and their estimated tokens per model, tenant and status, in one snapshot:
-- queued, running and offloaded counted live (the first two are bounded by the
-- concurrency windows, the last by what waits for the providers' Batch APIs; :models, the
-- registry's, through ix_items_model_status), pending
-- what was admitted less what finished and the other open ones (store.totals.open).
WITH
--! include finished_tail
, finished AS (
    SELECT model, tenant_id, sum(items) AS items, sum(tokens_est) AS tokens_est
    FROM (
        SELECT model, tenant_id, items, tokens_est FROM finished_totals
        UNION ALL
        SELECT model, tenant_id, 1, tokens_est FROM ended
    ) AS f
    GROUP BY model, tenant_id
),
live AS (
    SELECT model, tenant_id, status, count(*) AS items,
           sum(prompt_tokens_est + max_tokens) AS tokens_est
    FROM items
    WHERE status IN ('queued', 'running')
    GROUP BY model, tenant_id, status
    UNION ALL
    SELECT model, tenant_id, status, count(*), sum(prompt_tokens_est + max_tokens)
    FROM items
    WHERE model = ANY(CAST(:models AS text[])) AND status = 'offloaded'
    GROUP BY model, tenant_id, status
),
live_sum AS (
    SELECT model, tenant_id, sum(items) AS items, sum(tokens_est) AS tokens_est
    FROM live
    GROUP BY model, tenant_id
)
SELECT a.model, a.tenant_id, 'pending' AS status,
       a.items - coalesce(f.items, 0) - coalesce(l.items, 0) AS items,
       a.tokens_est - coalesce(f.tokens_est, 0) - coalesce(l.tokens_est, 0) AS tokens_est,
       (SELECT now_at FROM watermark) AS watermark
FROM admitted_totals AS a
LEFT JOIN finished AS f ON f.model = a.model AND f.tenant_id = a.tenant_id
LEFT JOIN live_sum AS l ON l.model = a.model AND l.tenant_id = a.tenant_id
WHERE (CAST(:model AS text) IS NULL OR a.model = :model)
  AND (CAST(:tenant_id AS integer) IS NULL OR a.tenant_id = :tenant_id)
UNION ALL
SELECT model, tenant_id, status, items, tokens_est, (SELECT now_at FROM watermark)
FROM live
WHERE (CAST(:model AS text) IS NULL OR model = :model)
  AND (CAST(:tenant_id AS integer) IS NULL OR tenant_id = :tenant_id)
