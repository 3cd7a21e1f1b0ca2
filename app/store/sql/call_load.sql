-- The calls open on a model (store.call_rows.call_load, the fail-fast rule): the tokens
-- they are estimated at (the calls ahead of a new one), and how many are the tenant's;
-- and whether the tenant has a dollar budget at all (none: its call reserves nothing,
-- worker.money_holds.reserve_call is skipped), asked only when :read_budget (a request's key
-- already said whether a budget applies).
SELECT COALESCE(SUM(prompt_tokens_est + max_tokens), 0) AS ahead_tokens,
       COUNT(*) FILTER (WHERE tenant_id = :tenant_id) AS own_open,
       CASE WHEN :read_budget
            THEN EXISTS (SELECT 1 FROM money_budgets AS b WHERE b.tenant_id = :tenant_id)
            ELSE false END AS has_budgets
FROM items
WHERE model = :model AND priority_rank = :call_rank
  AND status IN ('pending', 'offloaded', 'queued', 'running')
