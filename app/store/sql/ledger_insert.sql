-- One ledger row per (item, attempt), once; the tenant's daily totals follow it
-- in the same statement (its UTC day, the item's shard of tenant_daily_usage).
-- Returns the new ledger row's id, or no row when (item, attempt) was ledgered
-- already (then the daily totals are untouched).
WITH new_row AS (
    INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model,
                              prompt_tokens, completion_tokens, cost_usd, waste_reason)
    VALUES (:item_id, :attempt, :tenant_id, :batch_id, :model,
            :prompt_tokens, :completion_tokens, :cost_usd, :waste_reason)
    ON CONFLICT (item_id, attempt) DO NOTHING
    RETURNING id, created_at
), daily AS (
    INSERT INTO tenant_daily_usage AS d
        (tenant_id, day, model, shard, requests, prompt_tokens, completion_tokens, cost_usd)
    SELECT :tenant_id, CAST(timezone('UTC', new_row.created_at) AS date), :model, :shard, 1,
           :prompt_tokens, :completion_tokens, :cost_usd
    FROM new_row
    ON CONFLICT (tenant_id, day, model, shard) DO UPDATE
    SET requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd
)
SELECT id FROM new_row
