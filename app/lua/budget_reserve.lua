-- Reserve tokens and one request against a model's budget, and tokens
-- against the tenant's own budget if it has one: all or nothing.
--
-- Sliding window log: every reservation is a member of a sorted set scored
-- by its time; its token amount sits in a hash next to running totals.
-- A reservation counts for window_s + guard_s seconds, so any window of
-- window_s seconds holds at most `limit` tokens even if a call reaches the
-- provider up to guard_s after it was admitted. Time is Redis's own clock
-- (TIME), so skewed worker clocks cannot overshoot; tests may pass now_s.
--
-- KEYS[1] model log (zset)   KEYS[2] model amounts (hash)
-- KEYS[3] tenant log (zset)  KEYS[4] tenant amounts (hash)
-- KEYS[5] cooldown key (string with a TTL while the provider said 429)
-- ARGV: id, tokens, tokens_limit, requests_limit, tenant_tokens_limit (0 = none),
--       window_s, guard_s, now_s (empty = Redis TIME)
-- Returns {1, 0} when granted, {0, wait_ms} when denied, {-1, 0} when the
-- request can never fit (tokens above the limit).

local id = ARGV[1]
local tokens = tonumber(ARGV[2])
local tokens_limit = tonumber(ARGV[3])
local requests_limit = tonumber(ARGV[4])
local tenant_limit = tonumber(ARGV[5])
local span = tonumber(ARGV[6]) + tonumber(ARGV[7])
local now
if ARGV[8] ~= nil and ARGV[8] ~= '' then
    now = tonumber(ARGV[8])
else
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function expire(log, amounts)
    local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - span)
    if #old == 0 then return end
    local tokens_freed, requests_freed = 0, 0
    for _, member in ipairs(old) do
        tokens_freed = tokens_freed + (tonumber(redis.call('HGET', amounts, member)) or 0)
        if string.sub(member, 1, 2) ~= 'o:' then requests_freed = requests_freed + 1 end
        redis.call('HDEL', amounts, member)
    end
    redis.call('ZREMRANGEBYSCORE', log, '-inf', now - span)
    -- (never pass -0: Redis does not read "-0" as an integer)
    if tokens_freed > 0 then redis.call('HINCRBY', amounts, '_tokens', -tokens_freed) end
    if requests_freed > 0 then redis.call('HINCRBY', amounts, '_requests', -requests_freed) end
end

-- Seconds until `need` more tokens (or requests, when count_requests) are free.
local function wait_for(log, amounts, need, count_requests)
    local freed = 0
    local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
        local member = entries[i]
        if count_requests then
            if string.sub(member, 1, 2) ~= 'o:' then freed = freed + 1 end
        else
            freed = freed + (tonumber(redis.call('HGET', amounts, member)) or 0)
        end
        if freed >= need then
            return tonumber(entries[i + 1]) + span - now
        end
    end
    return span
end

local cooldown_ms = redis.call('PTTL', KEYS[5])
if cooldown_ms > 0 then
    return {0, cooldown_ms}
end
if tokens > tokens_limit or (tenant_limit > 0 and tokens > tenant_limit) then
    return {-1, 0}
end

expire(KEYS[1], KEYS[2])
local used = tonumber(redis.call('HGET', KEYS[2], '_tokens')) or 0
local requests = tonumber(redis.call('HGET', KEYS[2], '_requests')) or 0
local wait = 0
if used + tokens > tokens_limit then
    wait = math.max(wait, wait_for(KEYS[1], KEYS[2], used + tokens - tokens_limit, false))
end
if requests + 1 > requests_limit then
    wait = math.max(wait, wait_for(KEYS[1], KEYS[2], requests + 1 - requests_limit, true))
end
if tenant_limit > 0 then
    expire(KEYS[3], KEYS[4])
    local tenant_used = tonumber(redis.call('HGET', KEYS[4], '_tokens')) or 0
    if tenant_used + tokens > tenant_limit then
        wait = math.max(wait, wait_for(KEYS[3], KEYS[4], tenant_used + tokens - tenant_limit, false))
    end
end
if wait > 0 then
    return {0, math.ceil(wait * 1000)}
end

redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, tokens)
redis.call('HINCRBY', KEYS[2], '_tokens', tokens)
redis.call('HINCRBY', KEYS[2], '_requests', 1)
redis.call('PEXPIRE', KEYS[1], math.ceil(span * 2000))
redis.call('PEXPIRE', KEYS[2], math.ceil(span * 2000))
if tenant_limit > 0 then
    redis.call('ZADD', KEYS[3], now, id)
    redis.call('HSET', KEYS[4], id, tokens)
    redis.call('HINCRBY', KEYS[4], '_tokens', tokens)
    redis.call('PEXPIRE', KEYS[3], math.ceil(span * 2000))
    redis.call('PEXPIRE', KEYS[4], math.ceil(span * 2000))
end
return {1, 0}
