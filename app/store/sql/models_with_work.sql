-- The models among :models that have work for the dispatcher: a pending item ready to
-- run, or a deferred one whose time has come (store.items.models_with_work). One probe
-- of ix_items_pending_by_model or ix_items_deferred per model: an idle dispatch tick
-- asks this once instead of locking, counting and reading the ring of every model.
SELECT m.model
FROM unnest(CAST(:models AS text[])) AS m (model)
WHERE EXISTS (
        SELECT 1
        FROM items AS i
        WHERE i.model = m.model AND i.status = 'pending' AND i.not_before IS NULL
    )
   OR EXISTS (
        SELECT 1
        FROM items AS i
        WHERE i.model = m.model AND i.status = 'pending' AND i.not_before IS NOT NULL
          AND i.not_before <= now()
    )
