-- Ready items per model, the autoscaling signal's count (store.ready_items.ready): pending
-- and due (not deferred) or queued for a worker, with their mean estimated tokens
-- (prompt + max output). Each model's count stops at its :caps entry (its
-- max_concurrency: more ready items change neither gauge), so a scrape reads at most that
-- many index entries per model however long the backlog. KEDA's postgresql scaler may
-- run it with a group's models and caps spelled out, summing ready (docs/operations.md
-- "Kubernetes").
SELECT m.model,
       count(i.tokens) AS ready,
       coalesce(avg(i.tokens), 0) AS tokens_per_item
FROM unnest(CAST(:models AS text[]), CAST(:caps AS integer[])) AS m (model, cap)
CROSS JOIN LATERAL (
    SELECT prompt_tokens_est + max_tokens AS tokens
    FROM items
    WHERE items.model = m.model
      AND status IN ('pending', 'queued')
      AND (not_before IS NULL OR not_before <= now())
    LIMIT m.cap
) AS i
GROUP BY m.model
