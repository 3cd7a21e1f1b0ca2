-- The answer of a call ledgered as an estimate (worker_lost, superseded_in_flight)
-- arrived after all: its row takes the real usage (usage_source: the provider's), the
-- given waste reason (NULL: it became the result's row) and the deployment that
-- answered, and the daily totals of the row's own UTC day follow the difference, in
-- one statement. No row when (item, attempt) has no estimated row.
WITH old AS (
    SELECT id, prompt_tokens, completion_tokens, cost_usd, cached_tokens,
           cache_write_tokens, reasoning_tokens, deployment, waste_reason,
           CAST(timezone('UTC', created_at) AS date) AS day
    FROM usage_ledger
    WHERE item_id = :item_id AND attempt = :attempt
      AND waste_reason IN ('worker_lost', 'superseded_in_flight')
    FOR UPDATE
), updated AS (
    UPDATE usage_ledger AS u
    SET prompt_tokens = :prompt_tokens,
        completion_tokens = :completion_tokens,
        cached_tokens = :cached_tokens,
        cache_write_tokens = :cache_write_tokens,
        reasoning_tokens = :reasoning_tokens,
        cost_usd = :cost_usd,
        waste_reason = :waste_reason,
        deployment = COALESCE(:deployment, u.deployment),
        tier = :tier,
        usage_source = :usage_source
    FROM old
    WHERE u.id = old.id
    RETURNING u.id
), daily AS (
    -- An upsert: the estimate's totals may sit in another shard (rows ledgered before
    -- the shards existed are shard 0); the sum over the shards is what counts. The
    -- estimate is counted out of its deployment and waste, the answer in under the
    -- row's deployment and waste now: one row per key (summed when the key stays).
    INSERT INTO tenant_daily_usage AS d
        (tenant_id, day, model, deployment, shard, requests, prompt_tokens,
         completion_tokens, cost_usd, cached_tokens, cache_write_tokens, reasoning_tokens,
         wasted_requests, wasted_cost_usd)
    SELECT :tenant_id, old.day, :model, c.deployment, :shard, sum(c.n), sum(c.n * c.p),
           sum(c.n * c.c), sum(c.n * c.usd), sum(c.n * c.cached), sum(c.n * c.writes),
           sum(c.n * c.reasoning), sum(c.n * c.wasted), sum(c.n * c.wasted * c.usd)
    FROM old, LATERAL (VALUES
        (-1, COALESCE(old.deployment, ''),
         CASE WHEN old.waste_reason IS NULL THEN 0 ELSE 1 END, old.prompt_tokens,
         old.completion_tokens, old.cost_usd, old.cached_tokens, old.cache_write_tokens,
         old.reasoning_tokens),
        (1, COALESCE(CAST(:deployment AS text), old.deployment, ''),
         CASE WHEN CAST(:waste_reason AS text) IS NULL THEN 0 ELSE 1 END, :prompt_tokens,
         :completion_tokens, :cost_usd, :cached_tokens, :cache_write_tokens,
         :reasoning_tokens)
    ) AS c (n, deployment, wasted, p, c, usd, cached, writes, reasoning)
    GROUP BY old.day, c.deployment
    ON CONFLICT (tenant_id, day, model, deployment, shard) DO UPDATE
    SET requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens,
        cache_write_tokens = d.cache_write_tokens + EXCLUDED.cache_write_tokens,
        reasoning_tokens = d.reasoning_tokens + EXCLUDED.reasoning_tokens,
        wasted_requests = d.wasted_requests + EXCLUDED.wasted_requests,
        wasted_cost_usd = d.wasted_cost_usd + EXCLUDED.wasted_cost_usd
)
SELECT id FROM updated
