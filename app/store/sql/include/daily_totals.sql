daily AS (
    -- The tenant's daily totals follow each new ledger row (CTE ledgered: created_at),
    -- in its UTC day and the item's shard of tenant_daily_usage.
    INSERT INTO tenant_daily_usage AS d
        (tenant_id, day, model, shard, requests, prompt_tokens, completion_tokens, cost_usd)
    SELECT :tenant_id, CAST(timezone('UTC', ledgered.created_at) AS date), :model, :shard, 1,
           :prompt_tokens, :completion_tokens, :cost_usd
    FROM ledgered
    ON CONFLICT (tenant_id, day, model, shard) DO UPDATE
    SET requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd
)
