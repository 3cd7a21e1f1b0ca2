-- A flex call refused as busy (store.items.reroute): the attempt is handed back (the
-- provider billed nothing), the refusal counted, and the next call takes :route.
-- running -> queued with a lease covering the wait (the task retries itself), or
-- running -> pending not before now + wait_s (:defer; the dispatcher releases it).
-- sources / target come from the REROUTE move's declaration.
UPDATE items
SET status = :target, attempts = attempts - 1, sent_at = NULL,
    route = :route, flex_refusals = flex_refusals + 1,
    not_before = CASE WHEN CAST(:defer AS boolean)
                      THEN now() + make_interval(secs => :wait_s) END,
    lease_expires_at = CASE WHEN NOT CAST(:defer AS boolean)
                            THEN now() + make_interval(secs => :lease_s) END,
    error_code = :code, last_error = :message
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
RETURNING id
