-- running -> failed | expired | cancelled for this very attempt (store.items.finish).
UPDATE items
SET status = :target, finished_at = now(), lease_expires_at = NULL,
    error_code = :code, last_error = :message, rate_limited = rate_limited + :rate_limited
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
RETURNING id
