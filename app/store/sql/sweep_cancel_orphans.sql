-- Pending or queued items of a cancelled batch (a retry or a lease recovery
-- that raced with the cancel): they must never run; they end cancelled.
UPDATE items
SET status = 'cancelled',
    finished_at = now(),
    lease_expires_at = NULL,
    error_code = 'cancelled',
    last_error = 'batch cancelled'
FROM batches AS b
WHERE b.id = items.batch_id
  AND b.cancel_requested_at IS NOT NULL
  AND items.status IN ('pending', 'queued')
RETURNING items.id
