-- Leases that ran out: a lost broker message (queued) or a dead worker
-- (running). They go back to pending for the dispatcher, unless their batch
-- was cancelled (then they end cancelled: no new request after a cancel),
-- their deadline has passed (expired), or a running item has used all its
-- attempts (failed, with the reason).
UPDATE items
SET status = CASE
        WHEN b.cancel_requested_at IS NOT NULL THEN 'cancelled'
        WHEN items.deadline_at <= now() THEN 'expired'
        WHEN items.status = 'running' AND items.attempts >= :max_attempts THEN 'failed'
        ELSE 'pending'
    END,
    error_code = CASE
        WHEN b.cancel_requested_at IS NOT NULL THEN 'cancelled'
        WHEN items.deadline_at <= now() THEN 'expired'
        WHEN items.status = 'running' AND items.attempts >= :max_attempts THEN 'worker_lost'
        ELSE items.error_code
    END,
    last_error = CASE
        WHEN b.cancel_requested_at IS NOT NULL THEN 'batch cancelled'
        WHEN items.deadline_at <= now() THEN 'deadline passed'
        WHEN items.status = 'running' AND items.attempts >= :max_attempts
            THEN 'the worker running this item was lost on every attempt'
        WHEN items.status = 'running' THEN 'lease expired: worker lost, retrying'
        ELSE items.last_error
    END,
    finished_at = CASE
        WHEN b.cancel_requested_at IS NOT NULL
            OR items.deadline_at <= now()
            OR (items.status = 'running' AND items.attempts >= :max_attempts)
            THEN now()
        ELSE NULL
    END,
    lease_expires_at = NULL,
    sent_at = NULL
FROM batches AS b
WHERE b.id = items.batch_id
  AND items.status IN ('queued', 'running')
  AND items.lease_expires_at < now()
RETURNING items.id, items.batch_id, items.status
