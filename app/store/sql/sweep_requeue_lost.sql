-- Leases that ran out: a lost broker message (queued) or a dead worker
-- (running). They go back to pending for the dispatcher, unless their batch
-- was cancelled (then they end cancelled: no new request after a cancel),
-- their deadline has passed (expired), or a running item has used all its
-- attempts (failed, with the reason; failovers to another deployment use none of
-- them: the cap counts attempts - failovers). The attempt cap is the model's own,
-- never above the global one (:attempt_caps maps model -> cap; models not in
-- it use :max_attempts). :alive lists running items whose owner's heartbeat
-- is still live in Redis (a lease that ran out while PostgreSQL was away): not lost.
-- :callers_gone maps synchronous calls whose caller no longer waits (its API
-- process died) to the attempt seen so: they end cancelled, never run again for
-- nobody, their lease run out or not (nobody renews it any more), unless another
-- attempt (a worker's) has begun since.
--
-- ``was_sent``: the lost attempt's request had been sent, so the provider may
-- bill it; the caller ledgers it as waste in the same transaction (unless the claim
-- that marked it sent, ``claim_token``, is one whose worker lost its reply).
WITH lost AS (
    SELECT i.id,
        i.status = 'running' AND i.sent_at IS NOT NULL AS was_sent,
        COALESCE(
            (CAST(:callers_gone AS jsonb) ->> CAST(i.id AS text))::int = i.attempts, false
        ) AS caller_gone,
        CASE
            WHEN b.cancel_requested_at IS NOT NULL THEN 'cancelled'
            WHEN (CAST(:callers_gone AS jsonb) ->> CAST(i.id AS text))::int = i.attempts THEN 'cancelled'
            WHEN i.deadline_at <= now() THEN 'expired'
            WHEN i.status = 'running' AND i.attempts - i.failovers >= LEAST(
                :max_attempts,
                COALESCE((CAST(:attempt_caps AS jsonb) ->> i.model)::int, :max_attempts)
            ) THEN 'failed'
            ELSE 'pending'
        END AS next_status,
        i.status AS prev_status,
        i.claim_token
    FROM items AS i
    JOIN batches AS b ON b.id = i.batch_id
    WHERE i.status IN ('queued', 'running')
      AND (
          i.lease_expires_at < now()
          OR (CAST(:callers_gone AS jsonb) ->> CAST(i.id AS text))::int = i.attempts
      )
      AND i.id <> ALL(CAST(:alive AS bigint[]))
    ORDER BY i.id
    FOR UPDATE OF i
)
UPDATE items
SET status = lost.next_status,
    error_code = CASE
        WHEN lost.caller_gone AND lost.next_status = 'cancelled' THEN 'client_closed'
        WHEN lost.next_status = 'cancelled' THEN 'cancelled'
        WHEN lost.next_status = 'expired' THEN 'expired'
        WHEN lost.next_status = 'failed' THEN 'worker_lost'
        ELSE items.error_code
    END,
    last_error = CASE
        WHEN lost.caller_gone AND lost.next_status = 'cancelled'
            THEN 'the caller went away; call cancelled'
        WHEN lost.next_status = 'cancelled' THEN 'batch cancelled'
        WHEN lost.next_status = 'expired' THEN 'deadline passed'
        WHEN lost.next_status = 'failed'
            THEN 'the worker running this item was lost on every attempt'
        WHEN lost.prev_status = 'running' THEN 'lease expired: worker lost, retrying'
        ELSE items.last_error
    END,
    finished_at = CASE WHEN lost.next_status = 'pending' THEN NULL ELSE now() END,
    lease_expires_at = NULL,
    sent_at = NULL
FROM lost
WHERE items.id = lost.id
RETURNING items.id, items.batch_id, items.status, items.attempts, lost.was_sent,
    lost.prev_status, items.model, lost.claim_token
