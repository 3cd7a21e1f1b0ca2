-- running -> queued, the attempt not counted (store.items.requeue): a short budget
-- wait, an attempt handed back unsent, or a provider 429 (rate_limited = 1).
UPDATE items
SET status = :target, attempts = attempts - 1, sent_at = NULL,
    rate_limited = rate_limited + :rate_limited,
    lease_expires_at = now() + make_interval(secs => :lease_s)
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
RETURNING id
