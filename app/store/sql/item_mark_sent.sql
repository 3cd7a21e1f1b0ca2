-- Right before the provider request (store.items.mark_sent): no state move; a
-- cancel ends running items whose sent_at is NULL, so exactly one of the two wins.
UPDATE items SET sent_at = now()
WHERE id = :item_id AND status = 'running' AND attempts = :attempt
RETURNING id
