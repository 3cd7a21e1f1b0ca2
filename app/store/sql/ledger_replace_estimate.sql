-- The answer of a call ledgered as an estimate (worker_lost, superseded_in_flight)
-- arrived after all: its row takes the real usage (usage_source: the provider's) and the given waste reason
-- (NULL: it became the result's row), and the daily totals of the row's own UTC
-- day follow the difference, in one statement. No row when (item, attempt) has
-- no estimated row.
WITH old AS (
    SELECT id, prompt_tokens, completion_tokens, cost_usd, cached_tokens,
           cache_write_tokens, reasoning_tokens,
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
    -- the shards existed are shard 0); the sum over the shards is what counts.
    INSERT INTO tenant_daily_usage AS d
        (tenant_id, day, model, shard, requests, prompt_tokens, completion_tokens, cost_usd,
         cached_tokens, cache_write_tokens, reasoning_tokens)
    SELECT :tenant_id, old.day, :model, :shard, 0, :prompt_tokens - old.prompt_tokens,
           :completion_tokens - old.completion_tokens, :cost_usd - old.cost_usd,
           :cached_tokens - old.cached_tokens, :cache_write_tokens - old.cache_write_tokens,
           :reasoning_tokens - old.reasoning_tokens
    FROM old
    ON CONFLICT (tenant_id, day, model, shard) DO UPDATE
    SET prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens,
        cache_write_tokens = d.cache_write_tokens + EXCLUDED.cache_write_tokens,
        reasoning_tokens = d.reasoning_tokens + EXCLUDED.reasoning_tokens
)
SELECT id FROM updated
