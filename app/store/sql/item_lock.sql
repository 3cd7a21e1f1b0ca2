-- An item locked for recording a call's outcome (store.items.lock): a duplicate run
-- of the same item waits here and then sees the first one's verdict.
SELECT id, batch_id, tenant_id, model, status, attempts, sent_at, prompt_tokens_est,
       deployment, max_tokens
FROM items WHERE id = :item_id
FOR UPDATE
