-- Leases that ran out: a lost broker message (queued) or a dead worker
-- (running). They go back to pending for the dispatcher, unless a running
-- item has used all its attempts (then it fails with the reason) or its
-- deadline has passed (then it expires).
UPDATE items
SET status = CASE
        WHEN deadline_at <= now() THEN 'expired'
        WHEN status = 'running' AND attempts >= :max_attempts THEN 'failed'
        ELSE 'pending'
    END,
    error_code = CASE
        WHEN deadline_at <= now() THEN 'expired'
        WHEN status = 'running' AND attempts >= :max_attempts THEN 'worker_lost'
        ELSE error_code
    END,
    last_error = CASE
        WHEN deadline_at <= now() THEN 'deadline passed'
        WHEN status = 'running' AND attempts >= :max_attempts
            THEN 'the worker running this item was lost on every attempt'
        WHEN status = 'running' THEN 'lease expired: worker lost, retrying'
        ELSE last_error
    END,
    finished_at = CASE
        WHEN deadline_at <= now() OR (status = 'running' AND attempts >= :max_attempts)
            THEN now()
        ELSE NULL
    END,
    lease_expires_at = NULL
WHERE status IN ('queued', 'running')
  AND lease_expires_at < now()
RETURNING id, batch_id, status
