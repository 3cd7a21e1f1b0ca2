-- The models among :models that have work for the dispatcher: a pending item ready to
-- run, or a deferred one whose time has come (store.items.models_with_work). Per model,
-- at most two index probes, each the first row of its index in that index's own order
-- (ix_items_pending_by_model, then ix_items_deferred): an idle dispatch tick asks this
-- once instead of locking, counting and reading the ring of every model.
SELECT m.model
FROM unnest(CAST(:models AS text[])) AS m (model)
CROSS JOIN LATERAL (
    SELECT 1 AS found
    FROM (
        (SELECT 1
         FROM items AS i
         WHERE i.model = m.model AND i.status = 'pending' AND i.not_before IS NULL
         ORDER BY i.tenant_id
         LIMIT 1)
        UNION ALL
        (SELECT 1
         FROM items AS i
         WHERE i.model = m.model AND i.status = 'pending' AND i.not_before IS NOT NULL
           AND i.not_before <= now()
         ORDER BY i.not_before
         LIMIT 1)
    ) AS either
    LIMIT 1
) AS work
