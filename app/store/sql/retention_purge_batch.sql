-- Batch :batch_id goes, once its items have (store.retention.purge_batch_row), with its
-- provider jobs and their rows, its notifications and any ledger row left naming it
-- (its totals go by ON DELETE CASCADE). Each is found by an index, and so is what the
-- foreign keys check when the batch and its jobs go.
WITH job_rows AS (
    DELETE FROM provider_job_items
    WHERE job_id IN (SELECT j.id FROM provider_jobs AS j WHERE j.batch_id = :batch_id)
),
jobs AS (
    DELETE FROM provider_jobs WHERE batch_id = :batch_id
),
notes AS (
    DELETE FROM batch_notifications WHERE batch_id = :batch_id
),
ledger_rows AS (
    DELETE FROM usage_ledger WHERE batch_id = :batch_id
)
DELETE FROM batches WHERE id = :batch_id
