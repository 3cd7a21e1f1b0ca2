-- An item as the ledger needs it (store.items.lock, unlocked).
SELECT id, batch_id, tenant_id, model, status, attempts, sent_at, prompt_tokens_est,
       deployment, max_tokens
FROM items WHERE id = :item_id
