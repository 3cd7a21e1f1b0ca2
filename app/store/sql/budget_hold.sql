-- A tenant's own budget turned an item away for :wait_s (store.rounds.hold_tenant): the
-- dispatcher passes the tenant over until then. The latest word of the budget wins, a
-- shorter wait too (its window freed sooner than an earlier item's estimate).
INSERT INTO budget_holds (tenant_id, held_until)
VALUES (:tenant_id, now() + make_interval(secs => :wait_s))
ON CONFLICT (tenant_id) DO UPDATE SET held_until = excluded.held_until
