-- running -> pending, not before now + wait_s (store.items.retry_later); not when
-- the batch was cancelled meanwhile: the item must not run again.
UPDATE items
SET status = :target, not_before = now() + make_interval(secs => :wait_s),
    lease_expires_at = NULL, sent_at = NULL, error_code = :code, last_error = :message
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
  AND NOT EXISTS (
      SELECT 1 FROM batches AS b
      WHERE b.id = items.batch_id AND b.cancel_requested_at IS NOT NULL
  )
RETURNING id
