-- Concurrency slots held now (leases not yet expired), on Redis's clock: the
-- scores were written by slot_acquire.lua from Redis TIME, so a worker's or
-- API host's own clock must not be compared with them.
-- KEYS[1] slots (zset)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
