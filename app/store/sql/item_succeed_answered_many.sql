-- The group commit of a pack's paid answers (store.items.succeed_answered_many): for
-- each answer, what item_succeed_answered.sql does for one, all in one statement and
-- one round trip. Each attempt of a running item is locked (in id order: the arrays
-- come sorted), found by its key alone (OFFSET 0: as item_claim_sent_many.sql), its ledger row
-- written, the result stored and the item moved running -> succeeded; the tenants'
-- daily totals get one row per (tenant, day, model, deployment) of the group, in the
-- shard :shard (one of the group's items'), added up in key order so that two groups
-- never wait for each other's rows in opposite orders.
-- An answer whose attempt no longer runs the item, or that has a result or a ledger row
-- already, writes nothing (recorded = false): the caller takes the general path for it
-- (store.ledger.record_success). Online answers at their tier, never waste.
-- Every :array parameter has one element per answer, in the same order. (Under
-- psycopg's 4 096 bytes of parse cache, comments left out.)
-- sources / target come from the SUCCEED_ANSWERED move's declaration.
WITH answer AS (
    SELECT *
    FROM unnest(CAST(:item_id AS bigint[]), CAST(:attempt AS int[]),
                CAST(:tenant_id AS bigint[]), CAST(:batch_id AS text[]),
                CAST(:model AS text[]), CAST(:prompt_tokens AS int[]),
                CAST(:completion_tokens AS int[]), CAST(:cached_tokens AS int[]),
                CAST(:cache_write_tokens AS int[]), CAST(:reasoning_tokens AS int[]),
                CAST(:cost_usd AS numeric[]), CAST(:deployment AS text[]),
                CAST(:tier AS text[]), CAST(:response AS jsonb[]),
                CAST(:provider_request_id AS text[]), CAST(:upstream_latency_ms AS int[]),
                CAST(:queue_wait_ms AS int[]))
         AS a(item_id, attempt, tenant_id, batch_id, model, prompt_tokens,
              completion_tokens, cached_tokens, cache_write_tokens, reasoning_tokens,
              cost_usd, deployment, tier, response, provider_request_id,
              upstream_latency_ms, queue_wait_ms)
), locked AS (
    SELECT l.id FROM answer AS a CROSS JOIN LATERAL (
        SELECT i.id, i.status, i.attempts,
               EXISTS (SELECT 1 FROM results AS r WHERE r.item_id = i.id) AS answered
        FROM items AS i WHERE i.id = a.item_id OFFSET 0 FOR UPDATE OF i) AS l
    WHERE l.status = ANY(:sources) AND l.attempts = a.attempt AND NOT l.answered
), ledgered AS (
    INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model,
                              prompt_tokens, completion_tokens, cached_tokens,
                              cache_write_tokens, reasoning_tokens, cost_usd, waste_reason,
                              deployment, tier)
    SELECT a.item_id, a.attempt, a.tenant_id, a.batch_id, a.model, a.prompt_tokens,
           a.completion_tokens, a.cached_tokens, a.cache_write_tokens, a.reasoning_tokens,
           a.cost_usd, NULL, a.deployment, a.tier
    FROM locked JOIN answer AS a ON a.item_id = locked.id
    ON CONFLICT (item_id, attempt) DO NOTHING
    RETURNING item_id, created_at, deployment
), daily AS (
    -- Online answers, no waste: the wasted and offline totals keep their defaults (0).
    INSERT INTO tenant_daily_usage AS d
        (tenant_id, day, model, deployment, shard, requests, prompt_tokens,
         completion_tokens, cost_usd, cached_tokens, cache_write_tokens, reasoning_tokens)
    SELECT a.tenant_id, CAST(timezone('UTC', l.created_at) AS date) AS day, a.model,
           COALESCE(l.deployment, '') AS dep, :shard, count(*), sum(a.prompt_tokens),
           sum(a.completion_tokens), sum(a.cost_usd), sum(a.cached_tokens),
           sum(a.cache_write_tokens), sum(a.reasoning_tokens)
    FROM ledgered AS l JOIN answer AS a ON a.item_id = l.item_id
    GROUP BY a.tenant_id, day, a.model, dep
    ORDER BY a.tenant_id, day, a.model, dep
    ON CONFLICT (tenant_id, day, model, deployment, shard) DO UPDATE
    SET requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens,
        cache_write_tokens = d.cache_write_tokens + EXCLUDED.cache_write_tokens,
        reasoning_tokens = d.reasoning_tokens + EXCLUDED.reasoning_tokens
), resulted AS (
    INSERT INTO results (item_id, batch_id, tenant_id, attempt, response, provider_request_id,
                         prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens,
                         reasoning_tokens, cost_usd, upstream_latency_ms, queue_wait_ms)
    SELECT a.item_id, a.batch_id, a.tenant_id, a.attempt, a.response, a.provider_request_id,
           a.prompt_tokens, a.completion_tokens, a.cached_tokens, a.cache_write_tokens,
           a.reasoning_tokens, a.cost_usd, a.upstream_latency_ms, a.queue_wait_ms
    FROM ledgered AS l JOIN answer AS a ON a.item_id = l.item_id
    ON CONFLICT (item_id) DO NOTHING
    RETURNING item_id
), succeeded AS (
    UPDATE items
    SET status = :target, finished_at = now(), lease_expires_at = NULL,
        error_code = NULL, last_error = NULL
    WHERE id IN (SELECT item_id FROM resulted)
    RETURNING id
)
-- Each batch as of this statement's snapshot, in which the group's items still run:
-- one probe of ix_items_batch_id_status_line_no per waiting status, each by equality
-- and in the index's order, so that any plan (a prepared statement's, for any batch
-- id, expects a batch to hold most items) takes the index, never a scan of the table.
-- Once a batch (MATERIALIZED: inlined, the probes ran again for every answer of it),
-- and from the highest line: a batch is released and claimed in line order, so the
-- entries its items left behind as they moved on (pending -> queued -> running, dead
-- until a vacuum) lie below the live ones, which the probe meets first.
, batch AS MATERIALIZED (
    SELECT d.batch_id, EXISTS (
        SELECT 1 FROM (VALUES ('queued'), ('pending'), ('offloaded')) AS v(status),
             LATERAL (SELECT 1 FROM items AS w WHERE w.batch_id = d.batch_id
                      AND w.status = v.status ORDER BY w.line_no DESC LIMIT 1) AS f)
        AS waiting
    FROM (SELECT DISTINCT answer.batch_id FROM answer) AS d
)
SELECT a.item_id, EXISTS (SELECT 1 FROM succeeded AS s WHERE s.id = a.item_id) AS recorded,
       batch.waiting
FROM answer AS a JOIN batch ON batch.batch_id = a.batch_id
