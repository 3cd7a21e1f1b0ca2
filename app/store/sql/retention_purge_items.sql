-- Up to :limit items of batch :batch_id go, with the rows that name them (provider job
-- rows, ledger rows, results), in one statement (store.retention.purge_items). Each is
-- found by an index, and so is what the foreign keys check when the items go.
WITH doomed AS (
    SELECT i.id FROM items AS i WHERE i.batch_id = :batch_id LIMIT :limit
),
job_rows AS (
    DELETE FROM provider_job_items WHERE item_id IN (SELECT id FROM doomed)
),
ledger_rows AS (
    DELETE FROM usage_ledger WHERE item_id IN (SELECT id FROM doomed)
),
result_rows AS (
    DELETE FROM results WHERE item_id IN (SELECT id FROM doomed)
)
DELETE FROM items WHERE id IN (SELECT id FROM doomed)
RETURNING id
