-- running -> queued, the attempt not counted (store.items.requeue_lost_claim): a claim
-- whose reply was lost, handed back in case it committed. Only that very claim
-- (:claim_token): once the sweep has taken the item back, another worker's claim may
-- carry the same attempt number, and it is left.
UPDATE items
SET status = :target, attempts = attempts - 1, sent_at = NULL,
    lease_expires_at = now() + make_interval(secs => :lease_s)
WHERE id = :item_id AND status = ANY(:sources) AND attempts = :attempt
  AND claim_token = :claim_token
RETURNING id
