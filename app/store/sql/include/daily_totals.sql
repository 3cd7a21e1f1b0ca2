daily AS (
    -- The tenant's daily totals follow each new ledger row (CTE ledgered: created_at,
    -- deployment, waste_reason), in its UTC day, deployment ('' for none) and the
    -- item's shard of tenant_daily_usage; a row of a provider job (:route 'offline')
    -- also counts in the offline totals, with what it saved against the online price
    -- (:online_cost_usd), and a row of waste in the wasted ones.
    INSERT INTO tenant_daily_usage AS d
        (tenant_id, day, model, deployment, shard, requests, prompt_tokens,
         completion_tokens, cost_usd, wasted_requests, wasted_cost_usd,
         cached_tokens, cache_write_tokens, reasoning_tokens, offline_requests, offline_prompt_tokens, offline_completion_tokens,
         offline_cost_usd, saved_usd)
    SELECT :tenant_id, CAST(timezone('UTC', ledgered.created_at) AS date), :model,
           COALESCE(ledgered.deployment, ''), :shard, 1, :prompt_tokens, :completion_tokens,
           :cost_usd, w.requests, w.requests * :cost_usd,
           :cached_tokens, :cache_write_tokens, :reasoning_tokens, o.requests, o.requests * :prompt_tokens, o.requests * :completion_tokens,
           o.requests * :cost_usd, o.requests * (COALESCE(:online_cost_usd, :cost_usd) - :cost_usd)
    FROM ledgered, (SELECT CASE WHEN :route = 'offline' THEN 1 ELSE 0 END AS requests) AS o,
         LATERAL (SELECT CASE WHEN ledgered.waste_reason IS NULL THEN 0 ELSE 1 END
                  AS requests) AS w
    ON CONFLICT (tenant_id, day, model, deployment, shard) DO UPDATE
    SET requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd,
        wasted_requests = d.wasted_requests + EXCLUDED.wasted_requests,
        wasted_cost_usd = d.wasted_cost_usd + EXCLUDED.wasted_cost_usd,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens,
        cache_write_tokens = d.cache_write_tokens + EXCLUDED.cache_write_tokens,
        reasoning_tokens = d.reasoning_tokens + EXCLUDED.reasoning_tokens,
        offline_requests = d.offline_requests + EXCLUDED.offline_requests,
        offline_prompt_tokens = d.offline_prompt_tokens + EXCLUDED.offline_prompt_tokens,
        offline_completion_tokens = d.offline_completion_tokens
                                    + EXCLUDED.offline_completion_tokens,
        offline_cost_usd = d.offline_cost_usd + EXCLUDED.offline_cost_usd,
        saved_usd = d.saved_usd + EXCLUDED.saved_usd
)
