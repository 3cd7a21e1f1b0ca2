--! include clock
-- A global concurrency slot for a model: a sorted set of holders scored by
-- lease expiry, so a crashed worker's slot frees itself when its lease ends.
-- KEYS[1] slots (zset)  ARGV: holder, limit, lease_s
-- Returns 1 when acquired, 0 when all slots are held.
local now = clock()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
    return 1
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
    return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
