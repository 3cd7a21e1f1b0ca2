-- The hot path's record of a paid answer, one statement and one round trip
-- (store.items.succeed_answered): this very attempt of a running item is locked,
-- its ledger row and the tenant's daily totals written, the result stored, the item
-- moved running -> succeeded, and where its batch stands read (a call's batch closed).
-- Nothing is written (recorded = false) unless the item is still running this
-- attempt, has no result and (item, attempt) no ledger row: the caller then takes the
-- general path (store.ledger.record_success), which sorts out what happened.
-- sources / target come from the SUCCEED_ANSWERED move's declaration.
WITH locked AS (
    SELECT i.id FROM items AS i
    WHERE i.id = :item_id AND i.status = ANY(:sources) AND i.attempts = :attempt
      AND NOT EXISTS (SELECT 1 FROM results AS r WHERE r.item_id = i.id)
    FOR UPDATE
), ledgered AS (
    INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model,
                              prompt_tokens, completion_tokens, cached_tokens,
                              cache_write_tokens, reasoning_tokens, cost_usd, waste_reason,
                              deployment, tier)
    SELECT locked.id, :attempt, :tenant_id, :batch_id, :model, :prompt_tokens,
           :completion_tokens, :cached_tokens, :cache_write_tokens, :reasoning_tokens,
           :cost_usd, NULL, :deployment, :tier
    FROM locked
    ON CONFLICT (item_id, attempt) DO NOTHING
    RETURNING item_id, created_at, deployment, waste_reason
),
--! include daily_totals
, resulted AS (
    INSERT INTO results (item_id, batch_id, tenant_id, attempt, response, provider_request_id,
                         prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens,
                         reasoning_tokens, cost_usd, upstream_latency_ms, queue_wait_ms)
    SELECT ledgered.item_id, :batch_id, :tenant_id, :attempt, :response, :provider_request_id,
           :prompt_tokens, :completion_tokens, :cached_tokens, :cache_write_tokens,
           :reasoning_tokens, :cost_usd, :upstream_latency_ms, :queue_wait_ms
    FROM ledgered
    ON CONFLICT (item_id) DO NOTHING
    RETURNING item_id
), succeeded AS (
    UPDATE items
    SET status = :target, finished_at = now(), lease_expires_at = NULL,
        error_code = NULL, last_error = NULL
    WHERE id IN (SELECT item_id FROM resulted)
    RETURNING id
), closed AS (
    -- A synchronous call's batch of one is finished with its item, as
    -- store.batches.refresh_status would finish it.
    UPDATE batches
    SET status = CASE WHEN cancel_requested_at IS NULL THEN 'completed' ELSE 'cancelled' END,
        finished_at = now()
    WHERE id = :batch_id AND priority = 'call' AND total_items = 1 AND finished_at IS NULL
      AND EXISTS (TABLE succeeded)
    RETURNING id
)
-- The batch as of this statement's snapshot, in which this item is still running.
SELECT EXISTS (SELECT 1 FROM succeeded) AS recorded,
       EXISTS (SELECT 1 FROM items
               WHERE batch_id = :batch_id AND status IN ('pending', 'offloaded', 'queued')) AS waiting,
       EXISTS (SELECT 1 FROM items
               WHERE batch_id = :batch_id AND status = 'running' AND id <> :item_id) AS running,
       EXISTS (SELECT 1 FROM closed) AS closed
