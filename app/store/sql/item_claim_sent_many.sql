-- queued -> running, sent, for every item of a pack in one statement
-- (store.items.claim_sent_many): item_claim_sent.sql for many tickets at once. The gate
-- let each call through before the claim; an item is claimed only for its message's
-- attempt (the next one), before its deadline and while its batch is not cancelled.
-- The items are locked one after another in the arrays' order, which is the ids'
-- (store.items.claim_sent_many sorts them), so two statements over the same items (a
-- duplicate delivery) wait for each other rather than deadlock.
-- :claim_token names this claim (every item of it). :item_ids, :attempts and
-- :deployments are arrays of the same length.
-- Every item is found by its primary key, one at a time, whatever the planner
-- believes of the table: each is locked in a lateral subquery that only the key can
-- search (OFFSET 0 keeps the conditions on what it found out of it), and the batch's
-- and the tenant's columns are looked up by theirs. As joins, on a table grown since
-- its statistics (a fresh database, a large batch), plans scanned the batch's or the
-- queue's items for every item claimed: 70 ms for a pack of 32 of a 2 000-item
-- batch, 4 ms this way.
-- sources / target come from the CLAIM move's declaration.
WITH locked AS (
    SELECT l.id, w.deployment
    FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS int[]),
                CAST(:deployments AS text[])) AS w(item_id, attempt, deployment)
    CROSS JOIN LATERAL (
        SELECT i.id, i.status, i.attempts, i.deadline_at,
               (SELECT b.cancel_requested_at FROM batches AS b WHERE b.id = i.batch_id)
                   AS cancel_requested_at
        FROM items AS i
        WHERE i.id = w.item_id
        OFFSET 0  -- a fence: the conditions below stay out, only the key finds the row
        FOR UPDATE OF i
    ) AS l
    WHERE l.status = ANY(:sources) AND l.attempts = w.attempt - 1
      AND l.deadline_at > now()
      AND l.cancel_requested_at IS NULL  -- handed back after a cancel: never sent again
)
UPDATE items AS i
SET status = :target, attempts = i.attempts + 1, started_at = now(), sent_at = now(),
    lease_expires_at = now() + make_interval(secs => :lease_s), deployment = locked.deployment,
    claim_token = :claim_token
FROM locked
WHERE i.id = locked.id AND i.id = ANY(CAST(:item_ids AS bigint[]))
RETURNING i.id, i.batch_id, i.tenant_id, i.model, i.body, i.attempts, i.deadline_at,
          i.created_at, i.started_at, i.prompt_tokens_est, i.max_tokens,
          (SELECT t.tokens_per_min FROM tenants AS t WHERE t.id = i.tenant_id)
              AS tokens_per_min,
          i.lease_expires_at, i.rate_limited,
          (SELECT b.endpoint FROM batches AS b WHERE b.id = i.batch_id) AS endpoint,
          i.failovers, i.route, i.flex_refusals, i.prefix_key, now() AS now
