-- Batches still open although none of their items is.
SELECT b.id
FROM batches AS b
WHERE b.finished_at IS NULL
  AND NOT EXISTS (
      SELECT 1 FROM items AS i
      WHERE i.batch_id = b.id
        AND i.status IN ('pending', 'offloaded', 'queued', 'running')
  )
