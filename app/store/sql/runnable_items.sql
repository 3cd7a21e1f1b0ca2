-- Ready items per model, the autoscaling signal's count (store.runnable.ready): pending
-- and due (not deferred) or queued for a worker, with their mean estimated tokens
-- (prompt + max output). :models, the registry's (a group's, for one number), through
-- ix_items_model_status. KEDA's postgresql scaler may run it with a group's models
-- spelled out, summing ready (docs/operations.md "Kubernetes").
SELECT model,
       count(*) AS ready,
       coalesce(avg(prompt_tokens_est + max_tokens), 0) AS tokens_per_item
FROM items
WHERE model = ANY(CAST(:models AS text[]))
  AND status IN ('pending', 'queued')
  AND (not_before IS NULL OR not_before <= now())
GROUP BY model
