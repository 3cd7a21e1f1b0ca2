-- One ledger row per (item, attempt), once; the tenant's daily totals follow it
-- in the same statement (its UTC day, the item's shard of tenant_daily_usage).
-- Returns the new ledger row's id, or no row when (item, attempt) was ledgered
-- already (then the daily totals are untouched).
WITH ledgered AS (
    INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model,
                              prompt_tokens, completion_tokens, cached_tokens,
                              cache_write_tokens, reasoning_tokens, cost_usd, waste_reason,
                              route, online_cost_usd, deployment, tier, usage_source)
    VALUES (:item_id, :attempt, :tenant_id, :batch_id, :model,
            :prompt_tokens, :completion_tokens, :cached_tokens,
            :cache_write_tokens, :reasoning_tokens, :cost_usd, :waste_reason,
            :route, :online_cost_usd, :deployment, :tier, :usage_source)
    ON CONFLICT (item_id, attempt) DO NOTHING
    RETURNING id, created_at, deployment, waste_reason
),
--! include daily_totals
SELECT id FROM ledgered
