-- queued -> running, sent, for every item of a pack in one statement
-- (store.items.claim_sent_many): item_claim_sent.sql for many tickets at once. The gate
-- let each call through before the claim; an item is claimed only for its message's
-- attempt (the next one), before its deadline and while its batch is not cancelled.
-- The items are locked in id order, so two statements over the same items (a
-- duplicate delivery) wait for each other rather than deadlock.
-- :claim_token names this claim (every item of it). :item_ids, :attempts and
-- :deployments are arrays of the same length. Each join on
-- items also says i.id = ANY(:item_ids): a prepared statement's generic plan knows no
-- array's length, and would otherwise scan the table.
-- sources / target come from the CLAIM move's declaration.
WITH wanted AS (
    SELECT w.item_id, w.attempt, w.deployment
    FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS int[]),
                CAST(:deployments AS text[])) AS w(item_id, attempt, deployment)
), locked AS (
    SELECT i.id, wanted.deployment
    FROM items AS i JOIN wanted ON wanted.item_id = i.id
    WHERE i.id = ANY(CAST(:item_ids AS bigint[]))  -- the primary key's index, in any plan
      AND i.status = ANY(:sources) AND i.attempts = wanted.attempt - 1
      AND i.deadline_at > now()
    ORDER BY i.id
    FOR UPDATE OF i
)
UPDATE items AS i
SET status = :target, attempts = i.attempts + 1, started_at = now(), sent_at = now(),
    lease_expires_at = now() + make_interval(secs => :lease_s), deployment = locked.deployment,
    claim_token = :claim_token
FROM locked, tenants AS t, batches AS b
WHERE i.id = locked.id AND i.id = ANY(CAST(:item_ids AS bigint[]))
  AND t.id = i.tenant_id AND b.id = i.batch_id
  AND b.cancel_requested_at IS NULL  -- handed back after a cancel: never sent again
RETURNING i.id, i.batch_id, i.tenant_id, i.model, i.body, i.attempts, i.deadline_at,
          i.created_at, i.started_at, i.prompt_tokens_est, i.max_tokens,
          t.tokens_per_min, i.lease_expires_at, i.rate_limited, b.endpoint, i.failovers,
          i.route, i.flex_refusals, i.prefix_key, now() AS now
