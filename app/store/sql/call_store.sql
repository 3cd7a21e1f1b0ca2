-- A synchronous call stored and released in one statement and one round trip
-- (store.call_rows.store_plain_call), as store.batches.store_batch and
-- store.items.release_call would in several: its batch of one, its item queued at
-- once with its queued lease (keyed from the tenant's dispatch clock on the model, as
-- rounds.next_keys keys a batch's items), the tenant's admitted totals; returns the
-- item's ticket (store.items.Ticket's columns).
-- (Parameters used more than once are cast: one type for each.)
WITH batch AS (
    INSERT INTO batches (id, tenant_id, status, endpoint, priority, completion_window_s,
                         deadline_at, offload, route, origin, total_items, request_sha256,
                         key_id, created_at)
    VALUES (:id, CAST(:tenant_id AS integer), :status, :endpoint, :priority, :completion_window_s,
            now() + make_interval(secs => :window_s), :offload, :route, :origin, 1,
            :request_sha256, CAST(:key_id AS bigint), now())
    RETURNING id, created_at, deadline_at
), item AS (
    INSERT INTO items (batch_id, tenant_id, line_no, custom_id, model, priority_rank, body,
                       prompt_tokens_est, max_tokens, status, deadline_at, dispatch_key,
                       route, prefix_key, queued_at, lease_expires_at)
    SELECT batch.id, CAST(:tenant_id AS integer), :line_no, :custom_id, CAST(:model AS varchar), :priority_rank,
           CAST(:body AS jsonb), :prompt_tokens_est, :max_tokens, :queued,
           LEAST(batch.deadline_at, batch.created_at + make_interval(secs => :item_window_s)),
           COALESCE((SELECT c.released_key FROM dispatch_clocks AS c
                     WHERE c.tenant_id = CAST(:tenant_id AS integer) AND c.model = CAST(:model AS varchar)), 0) + 1,
           :item_route, NULL, now(), now() + make_interval(secs => :queued_lease_s)
    FROM batch
    RETURNING id, batch_id, tenant_id, attempts, prompt_tokens_est, max_tokens, priority_rank
), admitted AS (
    INSERT INTO admitted_totals (model, tenant_id, items, tokens_est)
    SELECT CAST(:model AS varchar), CAST(:tenant_id AS integer), 1, CAST(:tokens_est AS bigint) FROM item
    ON CONFLICT (model, tenant_id) DO UPDATE
    SET items = admitted_totals.items + EXCLUDED.items,
        tokens_est = admitted_totals.tokens_est + EXCLUDED.tokens_est
)
SELECT item.id, item.batch_id, item.tenant_id, item.attempts, item.prompt_tokens_est,
       item.max_tokens, t.tokens_per_min, item.priority_rank, t.name, t.weight
FROM item JOIN tenants AS t ON t.id = item.tenant_id
