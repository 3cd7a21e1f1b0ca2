-- Items whose deadline passed before they started: they are never sent. An item its
-- dollar budget still held back (pending, error_code 'budget_exhausted', set by
-- store.items.unrelease) ends failed with that code, not expired.
UPDATE items
SET status = CASE
        WHEN status = 'pending' AND error_code = 'budget_exhausted' THEN 'failed'
        ELSE 'expired'
    END,
    finished_at = now(),
    lease_expires_at = NULL,
    error_code = CASE
        WHEN status = 'pending' AND error_code = 'budget_exhausted' THEN 'budget_exhausted'
        ELSE 'expired'
    END,
    last_error = CASE
        WHEN status = 'pending' AND error_code = 'budget_exhausted'
            THEN 'deadline passed while its dollar budget held it'
        ELSE 'deadline passed before the item could run'
    END
WHERE status IN ('pending', 'queued')
  AND deadline_at <= now()
RETURNING batch_id
