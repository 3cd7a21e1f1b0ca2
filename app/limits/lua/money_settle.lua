--! include clock
-- Settle reservations of one dollar budget's period (batchgen.limits.money_budgets).
--
-- KEYS[1]: the budget's hash of this period (see money_reserve.lua).
-- ARGV[1] = 'settle': ARGV[2] id, ARGV[3] actual_micros. The reservation is released
--   and its actual price added to 'used', once: an id not held is a no-op.
--   Returns {settled (1/0), used, reserved}.
-- ARGV[1] = 'sync': rebuild from the ledger. ARGV[2] the ledger's spend of the period
--   (micro-dollars), ARGV[3] cutoff (Redis seconds: reservations made before it and not
--   in flight are released), ARGV[4] ttl_s, ARGV[5] n, ARGV[6..5+n] ids ledgered
--   (released whatever their age), then pairs (id, amount) of the calls in flight
--   (each held, added at its amount if missing). 'used' becomes the
--   spend; 'reserved' the sum of what is held. Returns {used, reserved}.
local key = KEYS[1]
local mode = ARGV[1]
if mode == 'settle' then
    local id = 'r:' .. ARGV[2]
    local entry = redis.call('HGET', key, id)
    if not entry then
        return {0, tonumber(redis.call('HGET', key, 'used')) or 0,
            tonumber(redis.call('HGET', key, 'reserved')) or 0}
    end
    local amount = tonumber(string.match(entry, '^(%S+)')) or 0
    redis.call('HDEL', key, id)
    local reserved = redis.call('HINCRBY', key, 'reserved', -amount)
    if reserved < 0 then
        redis.call('HSET', key, 'reserved', 0)
        reserved = 0
    end
    local used = redis.call('HINCRBY', key, 'used', math.max(0, tonumber(ARGV[3]) or 0))
    return {1, used, reserved}
end

local spend = tonumber(ARGV[2]) or 0
local cutoff = tonumber(ARGV[3]) or 0
local ttl_ms = math.ceil(tonumber(ARGV[4]) * 1000)
local now = clock('')
local n_done = tonumber(ARGV[5]) or 0
local done = {}
for i = 6, 5 + n_done do done['r:' .. ARGV[i]] = true end
local in_flight = {}
for i = 6 + n_done, #ARGV - 1, 2 do
    local id = 'r:' .. ARGV[i]
    in_flight[id] = true
    if redis.call('HEXISTS', key, id) == 0 then
        redis.call('HSET', key, id, ARGV[i + 1] .. ' ' .. now)
    end
end
local reserved = 0
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, 2) == 'r:' then
        local amount, at = string.match(fields[i + 1], '^(%S+) (%S+)')
        if not in_flight[f] and (done[f] or (tonumber(at) or 0) < cutoff) then
            redis.call('HDEL', key, f)
        else
            reserved = reserved + (tonumber(amount) or 0)
        end
    end
end
-- 'used' becomes the spend, exactly: what settles added since the last rebuild (each
-- row rounded up) is in it, read after the calls in flight (a row committed after the
-- spend was read belongs to a call in flight, whose reservation is kept or re-added).
local used = spend
redis.call('HSET', key, 'used', used, 'reserved', reserved)
redis.call('PEXPIRE', key, ttl_ms)
return {used, reserved}
