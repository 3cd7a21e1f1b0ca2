-- open -> succeeded: a paid answer became the item's result (store.items.succeed).
UPDATE items
SET status = :target, finished_at = now(), lease_expires_at = NULL,
    error_code = NULL, last_error = NULL
WHERE id = :item_id AND status = ANY(:sources)
RETURNING id
