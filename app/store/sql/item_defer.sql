-- running -> pending with not_before, the attempt not counted (store.items.defer):
-- a long budget wait or a provider 429 (rate_limited = 1).
UPDATE items
SET status = :target, attempts = attempts - 1, sent_at = NULL,
    rate_limited = rate_limited + :rate_limited,
    not_before = now() + make_interval(secs => :wait_s), lease_expires_at = NULL,
    error_code = :code, last_error = :reason
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
RETURNING id
