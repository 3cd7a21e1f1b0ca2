ended AS (
    -- Items finished since the last roll-up (at or after the watermark :since, read
    -- just before; NULL: nothing rolled up yet): the part of the totals not rolled up
    -- yet, read through ix_items_finished_at.
    SELECT i.id, i.batch_id, i.model, i.tenant_id, i.status,
           i.prompt_tokens_est + i.max_tokens AS tokens_est
    FROM items AS i
    WHERE i.finished_at IS NOT NULL
      AND i.finished_at >= coalesce(CAST(:since AS timestamptz), '-infinity')
),
watermark AS (
    -- The watermark this statement sees: if it is no longer :since, a roll-up committed
    -- in between and the caller reads again (store.totals).
    SELECT w.rolled_up_before AS now_at FROM totals_watermark AS w WHERE w.id = 1
)
