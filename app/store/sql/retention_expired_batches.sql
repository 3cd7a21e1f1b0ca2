-- Batches finished more than :retention_s ago, the oldest first, at most :limit
-- (store.retention.expired_batches), read through ix_batches_finished_at: a synchronous
-- call is a batch of its own, so batches grow with the history.
SELECT b.id
FROM batches AS b
WHERE b.finished_at IS NOT NULL
  AND b.finished_at < now() - make_interval(secs => :retention_s)
ORDER BY b.finished_at
LIMIT :limit
