-- Items whose deadline passed before they started: they are never sent.
UPDATE items
SET status = 'expired',
    finished_at = now(),
    lease_expires_at = NULL,
    error_code = 'expired',
    last_error = 'deadline passed before the item could run'
WHERE status IN ('pending', 'queued')
  AND deadline_at <= now()
RETURNING batch_id
