-- The tenants with ready work on :model whose ids lie in [:lo, :hi), the lowest first,
-- at most :limit, with their weights (store.rounds reads the ring from its position
-- up, then from the lowest id). A skip scan of ix_items_pending_by_model: one index
-- probe per tenant found, so a round reads the tenants it can serve and no others,
-- however many tenants there are, busy or idle.
WITH RECURSIVE ring AS (
    (SELECT i.tenant_id
     FROM items AS i
     WHERE i.model = :model AND i.status = 'pending' AND i.not_before IS NULL
       AND i.tenant_id >= :lo AND i.tenant_id < :hi
     ORDER BY i.tenant_id
     LIMIT 1)
    UNION ALL
    SELECT (SELECT i.tenant_id
            FROM items AS i
            WHERE i.model = :model AND i.status = 'pending' AND i.not_before IS NULL
              AND i.tenant_id > r.tenant_id AND i.tenant_id < :hi
            ORDER BY i.tenant_id
            LIMIT 1)
    FROM ring AS r
    WHERE r.tenant_id IS NOT NULL
)
SELECT r.tenant_id, (SELECT t.weight FROM tenants AS t WHERE t.id = r.tenant_id) AS weight
FROM ring AS r
WHERE r.tenant_id IS NOT NULL
LIMIT :limit
