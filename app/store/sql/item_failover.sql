-- running -> queued, on to another deployment (store.items.failover): the call failed
-- there (429, 5xx, time-out, refused connection). The attempt number is kept (a billed
-- call has its ledger row under it; the next claim makes the next one) and counted as
-- a failover, which uses none of the item's failure attempts; a 429 counts on
-- rate_limited too. The lease covers the wait before the next delivery. Not when the
-- batch was cancelled meanwhile (the cancel left the sent item to its worker): the item
-- must not run again.
UPDATE items
SET status = :target, failovers = failovers + 1, sent_at = NULL,
    rate_limited = rate_limited + :rate_limited,
    lease_expires_at = now() + make_interval(secs => :lease_s),
    error_code = :code, last_error = :message
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
  AND NOT EXISTS (
      SELECT 1 FROM batches AS b
      WHERE b.id = items.batch_id AND b.cancel_requested_at IS NOT NULL
  )
RETURNING id
