-- The leases of items still in :status for the attempt named (store.items: a pack's
-- untried items that wait or are handed back, 'queued', never shortened; a worker's
-- heartbeat over its calls, 'running', :lease_s from now): each (:item_ids, :attempts)
-- pair's item, while its status and attempt are still those (a swept, re-released or
-- finished item is another delivery's, or nobody's).
-- Every item is found by its primary key, one at a time, whatever the planner
-- believes of the table (as in item_claim_sent_many.sql): locked in a lateral
-- subquery only the key can search, in the arrays' order (the ids', sorted by the
-- caller), its status and attempt read under the lock. An IN list of (id, attempts)
-- pairs was a filter of as many ORs on every running item (a second of PostgreSQL for
-- a few hundred pairs), and a plain join on stale statistics read the queue's index.
WITH held AS (
    SELECT l.id
    FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS integer[]))
        AS w(item_id, attempts)
    CROSS JOIN LATERAL (
        SELECT i.id, i.status, i.attempts
        FROM items AS i
        WHERE i.id = w.item_id
        OFFSET 0  -- a fence: the conditions below stay out, only the key finds the row
        FOR UPDATE OF i
    ) AS l
    WHERE l.status = :status AND l.attempts = w.attempts
)
UPDATE items AS i
SET lease_expires_at = CASE
    WHEN :never_shorten THEN greatest(i.lease_expires_at, now() + make_interval(secs => :lease_s))
    ELSE now() + make_interval(secs => :lease_s)
END
FROM held
WHERE i.id = held.id AND i.id = ANY(CAST(:item_ids AS bigint[]))
RETURNING i.id
