--! include clock
--! include window
-- A global concurrency slot for a model: a sorted set of holders scored by
-- lease expiry, so a crashed worker's slot frees itself when its lease ends.
-- (The gate takes its slot in budget_reserve.lua, with the budget, in one step.)
-- KEYS[1] slots (zset)  ARGV: holder, limit, lease_s
-- Returns 1 when acquired (or renewed), 0 when all slots are held.
local now = clock()
if not slot_free(KEYS[1], ARGV[1], tonumber(ARGV[2]), now) then
    return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
