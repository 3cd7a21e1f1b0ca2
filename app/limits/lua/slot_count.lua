--! include clock
-- Concurrency slots held now (leases not yet expired), on Redis's clock: the
-- scores were written by slot_acquire.lua from Redis TIME, so a worker's or
-- API host's own clock must not be compared with them.
-- KEYS[1] slots (zset)
local now = clock()
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
