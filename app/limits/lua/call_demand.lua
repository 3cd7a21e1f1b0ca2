--! include clock
-- What the tenants ask of one model's slots now, for the shares of sync calls: the
-- calls waiting (each renews its entry on every try: one that went away lapses after
-- ttl_s) and the calls holding a slot (their holders' tenants; a holder whose lease
-- ended is dropped). app/domain/scheduling/call_shares.py turns this into each tenant's share.
--
-- KEYS[1] sync calls asking for a slot (zset 'tenant:weight:item', score: lapse)
-- KEYS[2] the tenant of each slot holder (hash: holder -> 'tenant:weight[:call]')
-- KEYS[3] the model's concurrency slots (zset, score: lease end)
-- ARGV: 1 this call's entry ('' = only read), 2 ttl_s
-- Returns {waiting entries, holders' 'tenant:weight' values}.

local demand, holders, slots = KEYS[1], KEYS[2], KEYS[3]
local entry, ttl = ARGV[1] or '', tonumber(ARGV[2]) or 1
local now = clock()
redis.call('ZREMRANGEBYSCORE', demand, '-inf', now)
if entry ~= '' then
    redis.call('ZADD', demand, now + ttl, entry)
    redis.call('PEXPIRE', demand, math.ceil(ttl * 2000))
end
local running = {}
local entries = redis.call('HGETALL', holders)
for i = 1, #entries, 2 do
    local lease = redis.call('ZSCORE', slots, entries[i])
    if lease and tonumber(lease) > now then
        running[#running + 1] = entries[i + 1]
    else
        redis.call('HDEL', holders, entries[i])
    end
end
return {redis.call('ZRANGE', demand, 0, -1), running}
