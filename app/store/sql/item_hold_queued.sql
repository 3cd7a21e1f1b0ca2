-- The untried items of a pack that waits or is handed back (store.items.hold_queued):
-- their queued leases last :lease_s from now, never shortened; only where the item is
-- still queued for the attempt its message carries (a swept or re-released item is
-- another delivery's).
UPDATE items
SET lease_expires_at = greatest(lease_expires_at, now() + make_interval(secs => :lease_s))
FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS integer[])) AS held(id, attempts)
WHERE items.id = held.id
  AND items.status = 'queued'
  AND items.attempts = held.attempts
RETURNING items.id
