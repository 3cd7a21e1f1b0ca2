--! include clock
-- Reserve a call's worst-case price in every dollar budget it counts against (the
-- tenant's, its key's), all or nothing (batchgen.limits.money_budgets).
--
-- Each budget's period is one hash: 'used' (micro-dollars settled, at least the
-- ledger's spend of the period), 'reserved' (the sum of the reservations held) and
-- one field 'r:<id>' = '<amount> <time>' per reservation held. A hash without
-- 'used' has not been built from the ledger yet (a new period, or Redis lost its
-- data): nothing is reserved, the caller syncs it first (reply -2).
--
-- KEYS[i] (i < #KEYS): budget i's hash of this period; KEYS[#KEYS]: the reservation's
-- index (the hashes it is held in, space-separated), what settling it releases.
-- ARGV: id, now_s (empty = Redis TIME), ttl_s (each hash's expiry),
--       then per budget: amount_micros, limit_micros.
-- Returns {1, held_before} granted (held_before 1: the id held it already, nothing
-- added), {0, i, used, reserved} refused by budget i, {-2, i} budget i not built.
local id = 'r:' .. ARGV[1]
local now = clock(ARGV[2])
local ttl_ms = math.ceil(tonumber(ARGV[3]) * 1000)
local held = 0
local n = #KEYS - 1
local index = KEYS[#KEYS]
for i = 1, n do
    local key = KEYS[i]
    local amount = tonumber(ARGV[2 + 2 * i])
    local limit = tonumber(ARGV[3 + 2 * i])
    local used = redis.call('HGET', key, 'used')
    if not used then return {-2, i} end
    if redis.call('HEXISTS', key, id) == 1 then
        held = held + 1
    else
        local reserved = tonumber(redis.call('HGET', key, 'reserved')) or 0
        if tonumber(used) + reserved + amount > limit then
            return {0, i, tonumber(used), reserved}
        end
    end
end
local names = {}
for i = 1, n do
    local key = KEYS[i]
    names[i] = key
    local amount = tonumber(ARGV[2 + 2 * i])
    if redis.call('HEXISTS', key, id) == 0 then
        redis.call('HSET', key, id, amount .. ' ' .. now)
        redis.call('HINCRBY', key, 'reserved', amount)
    end
    redis.call('PEXPIRE', key, ttl_ms)
end
redis.call('SET', index, table.concat(names, ' '), 'PX', ttl_ms)
return {1, held == n and 1 or 0}
