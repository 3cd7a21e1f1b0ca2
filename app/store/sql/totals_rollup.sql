-- Items that finished in [:since, :until) join the rolled-up totals, and the watermark
-- moves to :until, in one statement (store.totals.roll_up). :since NULL: from the start.
WITH ended AS (
    SELECT i.id, i.batch_id, i.model, i.tenant_id, i.status,
           i.prompt_tokens_est + i.max_tokens AS tokens_est,
           i.custom_id, i.error_code, i.last_error
    FROM items AS i
    WHERE i.finished_at IS NOT NULL
      AND i.finished_at >= coalesce(CAST(:since AS timestamptz), '-infinity')
      AND i.finished_at < :until
),
per_model AS (
    INSERT INTO finished_totals AS t (model, tenant_id, status, items, tokens_est)
    SELECT model, tenant_id, status, count(*), sum(tokens_est)
    FROM ended
    GROUP BY model, tenant_id, status
    ON CONFLICT (model, tenant_id, status) DO UPDATE
    SET items = t.items + EXCLUDED.items, tokens_est = t.tokens_est + EXCLUDED.tokens_est
),
per_batch AS (
    -- With the bytes of the items' lines in the batch's output or error file.
    INSERT INTO batch_totals AS t (batch_id, status, items, bytes)
    SELECT i.batch_id, i.status, count(*), sum(octet_length(
--! include output_line
    ))
    FROM ended AS i
    LEFT JOIN results AS r ON r.item_id = i.id AND i.status = 'succeeded'
    GROUP BY i.batch_id, i.status
    ON CONFLICT (batch_id, status) DO UPDATE
    SET items = t.items + EXCLUDED.items, bytes = t.bytes + EXCLUDED.bytes
),
latencies AS (
    INSERT INTO latency_totals AS t (model, metric, le_ms, n, sum_ms)
--! include latency_rows
    ON CONFLICT (model, metric, le_ms) DO UPDATE
    SET n = t.n + EXCLUDED.n, sum_ms = t.sum_ms + EXCLUDED.sum_ms
)
UPDATE totals_watermark SET rolled_up_before = :until WHERE id = 1
