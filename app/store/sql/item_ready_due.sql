-- Deferred pending items of one model whose time has come become ready (not_before
-- cleared: the dispatcher's index holds ready items only), the earliest first, at most
-- :limit a round (store.items.ready_due).
UPDATE items
SET not_before = NULL
WHERE id IN (
    SELECT id
    FROM items
    WHERE model = :model
      AND status = 'pending'
      AND not_before IS NOT NULL
      AND not_before <= now()
    ORDER BY not_before
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
RETURNING id
