-- queued -> running with a lease (store.items.claim): the claim, one statement.
-- sources / target come from the CLAIM move's declaration; :attempt (when not NULL) is
-- the attempt the message expects to be, as in item_claim_sent.sql.
UPDATE items AS i
SET status = :target, attempts = i.attempts + 1, started_at = now(),
    lease_expires_at = now() + make_interval(secs => :lease_s)
FROM tenants AS t, batches AS b
WHERE i.id = :item_id AND i.status = ANY(:sources) AND i.deadline_at > now()
  AND (CAST(:attempt AS integer) IS NULL OR i.attempts = CAST(:attempt AS integer) - 1)
  AND t.id = i.tenant_id AND b.id = i.batch_id
  AND b.cancel_requested_at IS NULL  -- handed back after a cancel: never sent again
RETURNING i.id, i.batch_id, i.tenant_id, i.model, i.body, i.attempts, i.deadline_at,
          i.created_at, i.started_at, i.prompt_tokens_est, i.max_tokens,
          t.tokens_per_min, i.lease_expires_at, i.rate_limited, b.endpoint, i.failovers,
          i.route, i.flex_refusals, i.prefix_key, now() AS now
