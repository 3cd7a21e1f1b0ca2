-- queued -> running, sent (store.items.claim_sent): the gate let the call through
-- before the claim, so the claim marks it sent in the same statement. A cancel either
-- ended the item first (nothing matches) or finds it sent (the cancel watcher stops
-- the call). The message's attempt must be the next one: a stale message claims nothing.
-- :deployment is the deployment of the model the gate picked for the call; :claim_token
-- names this claim (a lost reply's hand-back and the sweep find it by it).
-- sources / target come from the CLAIM move's declaration.
UPDATE items AS i
SET status = :target, attempts = i.attempts + 1, started_at = now(), sent_at = now(),
    lease_expires_at = now() + make_interval(secs => :lease_s), deployment = :deployment,
    claim_token = :claim_token
FROM tenants AS t, batches AS b
WHERE i.id = :item_id AND i.status = ANY(:sources) AND i.attempts = :attempt - 1
  AND i.deadline_at > now() AND t.id = i.tenant_id AND b.id = i.batch_id
  AND b.cancel_requested_at IS NULL  -- handed back after a cancel: never sent again
RETURNING i.id, i.batch_id, i.tenant_id, i.model, i.body, i.attempts, i.deadline_at,
          i.created_at, i.started_at, i.prompt_tokens_est, i.max_tokens,
          t.tokens_per_min, i.lease_expires_at, i.rate_limited, b.endpoint, i.failovers,
          i.route, i.flex_refusals, i.prefix_key, now() AS now
