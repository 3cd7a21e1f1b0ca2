-- Note a key's use at :at unless one since :stale was noted (by anyone), or another
-- request is noting one now: a twin holding the row is skipped, not waited for
-- (store.api_keys.authenticate).
UPDATE api_keys SET last_used_at = :at
WHERE id = (SELECT id FROM api_keys
            WHERE id = :key_id AND (last_used_at IS NULL OR last_used_at <= :stale)
            FOR UPDATE SKIP LOCKED)
