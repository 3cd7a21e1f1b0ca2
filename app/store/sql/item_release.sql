-- pending -> queued for a dispatch round's picks (store.items.release_picks): up to
-- :takes[k] ready items of tenant :tenant_ids[k] on :model, in the tenant's order
-- (priority, then dispatch_key: its open batches of one priority take turns, then id),
-- skipping the items of a batch whose cancel was requested (a look-up of the item's
-- batch: an anti-join would read every batch, and a synchronous call is a batch of its
-- own) and rows another transaction holds. Each tenant's dispatch clock on the model moves on to the largest
-- key released (a batch submitted next is keyed from there).
WITH picked AS (
    SELECT c.id
    FROM unnest(CAST(:tenant_ids AS bigint[]), CAST(:takes AS integer[])) AS w (tenant_id, take)
    CROSS JOIN LATERAL (
        SELECT i.id
        FROM items AS i
        WHERE i.model = :model AND i.tenant_id = w.tenant_id
          AND i.status = 'pending' AND i.not_before IS NULL
          AND (SELECT b.cancel_requested_at FROM batches AS b WHERE b.id = i.batch_id) IS NULL
        ORDER BY i.priority_rank, i.dispatch_key, i.id
        LIMIT w.take
        FOR UPDATE OF i SKIP LOCKED
    ) AS c
),
released AS (
    UPDATE items
    SET status = :target, queued_at = now(),
        lease_expires_at = now() + make_interval(secs => :lease_s),
        -- no longer held by its dollar budget (store.items.unrelease marks it so)
        error_code = nullif(items.error_code, 'budget_exhausted')
    FROM picked, tenants AS t
    WHERE items.id = picked.id AND t.id = items.tenant_id AND items.status = ANY(:sources)
    RETURNING items.id, items.batch_id, items.tenant_id, items.attempts,
        items.prompt_tokens_est, items.max_tokens, t.tokens_per_min, items.priority_rank,
        t.name, t.weight, items.dispatch_key, items.prefix_key
),
clocks AS (
    INSERT INTO dispatch_clocks AS k (tenant_id, model, released_key)
    SELECT tenant_id, :model, max(dispatch_key) FROM released GROUP BY tenant_id
    ON CONFLICT (tenant_id, model) DO UPDATE
    SET released_key = greatest(k.released_key, EXCLUDED.released_key)
)
SELECT * FROM released
