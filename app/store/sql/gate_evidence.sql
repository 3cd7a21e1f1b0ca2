-- The database's evidence of recent use of the gate, read when Redis lost the
-- gate's state (batchgen.domain.scheduling.gate_rebuild): the items running now (their
-- current attempt and the seconds left of their lease), then the (model,
-- deployment) of calls billed online within the last :window_s seconds. The
-- ledger is read tenant by tenant on its (tenant_id, created_at) index.
SELECT 'running' AS kind, i.id AS item_id, i.attempts AS attempt, i.model, i.deployment,
    CAST(EXTRACT(EPOCH FROM i.lease_expires_at - now()) AS double precision) AS lease_left_s
FROM items AS i
WHERE i.status = 'running' AND i.lease_expires_at > now()
UNION ALL
SELECT DISTINCT 'billed' AS kind, CAST(NULL AS bigint), CAST(NULL AS integer), l.model,
    l.deployment, CAST(NULL AS double precision)
FROM tenants AS t
CROSS JOIN LATERAL (
    SELECT u.model, u.deployment
    FROM usage_ledger AS u
    WHERE u.tenant_id = t.id
      AND u.route = 'online'
      AND u.created_at > now() - make_interval(secs => CAST(:window_s AS double precision))
) AS l
