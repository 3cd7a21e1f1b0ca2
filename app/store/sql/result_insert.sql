-- The item's result, once (a second answer of the same item is ledgered as waste).
INSERT INTO results (item_id, batch_id, tenant_id, attempt, response, provider_request_id,
                     prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens,
                     reasoning_tokens, cost_usd, upstream_latency_ms, queue_wait_ms)
VALUES (:item_id, :batch_id, :tenant_id, :attempt, :response, :provider_request_id,
        :prompt_tokens, :completion_tokens, :cached_tokens, :cache_write_tokens,
        :reasoning_tokens, :cost_usd, :upstream_latency_ms, :queue_wait_ms)
ON CONFLICT (item_id) DO NOTHING
