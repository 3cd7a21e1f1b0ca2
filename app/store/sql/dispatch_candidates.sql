-- Pending items of one model, in weighted fair order across tenants.
--
-- Each tenant with pending work offers its first :limit items (interactive
-- before bulk, then submission order). An item's rank is
--   (items the tenant already has in flight on this model + its position) / weight
-- so every release goes to the tenant furthest below its weighted share of
-- the model's slots: weighted round-robin computed in one query.
--
-- Slots are whole: with 16 slots and weights 2:1 the exact share is 10.67 to
-- 5.33, and a plain rank would settle on 11 to 5 (a 2.2 ratio). Subtracting a
-- random fraction (stochastic rounding) makes the split alternate between
-- 11:5 and 10:6 so that throughput over time follows the weights. It never
-- reorders a tenant's own items: their ranks differ by at least 1/weight.
WITH inflight AS (
    SELECT tenant_id, count(*) AS n
    FROM items
    WHERE model = :model
      AND status IN ('queued', 'running')
    GROUP BY tenant_id
)
SELECT c.id
FROM tenants AS t
LEFT JOIN inflight AS f ON f.tenant_id = t.id
CROSS JOIN LATERAL (
    SELECT i.id,
           row_number() OVER (ORDER BY i.priority_rank, i.id) AS position
    FROM items AS i
    WHERE i.tenant_id = t.id
      AND i.model = :model
      AND i.status = 'pending'
      AND i.not_before IS NULL  -- deferred items join once due (store.items.ready_due)
      AND NOT EXISTS (
          SELECT 1 FROM batches AS b
          WHERE b.id = i.batch_id AND b.cancel_requested_at IS NOT NULL
      )
    ORDER BY i.priority_rank, i.id
    LIMIT :limit
) AS c
ORDER BY (coalesce(f.n, 0) + c.position - random()) / t.weight, c.id
LIMIT :limit
