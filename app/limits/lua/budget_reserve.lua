--! include clock
--! include window
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
-- Fairness: a caller denied by the model's budget joins a line of waiters
-- (by a stable id per item, not per attempt), ordered by its first denial.
-- The first `held_claims` waiters (at most one limit of tokens together) hold
-- a claim on the tokens they asked for: any other reservation is granted only
-- if it leaves room for the claims ahead of it, so freed capacity accumulates
-- for a large request instead of going to a stream of small ones. The first
-- waiter has nothing ahead of it, so the line always moves. A waiter's place
-- lasts claim_ttl_s from its last try, so a waiter that vanished frees its
-- claim by itself.
--
-- KEYS[1] model log (zset)   KEYS[2] model amounts (hash)
-- KEYS[3] tenant log (zset)  KEYS[4] tenant amounts (hash)
-- KEYS[5] cooldown key (string with a TTL while the provider said 429)
-- KEYS[6] waiters (zset, score: first denial)  KEYS[7] waiters' tokens (hash)
-- KEYS[8] waiters (zset, score: last try)
-- ARGV: id (one per item and attempt), tokens, tokens_limit, requests_limit, tenant_tokens_limit (0 = none),
--       window_s, guard_s, now_s (empty = Redis TIME), waiter id (empty = none),
--       claim_ttl_s, held_claims
-- Returns {1, 0, ''} when granted, {0, wait_ms, reason} when denied (reason:
-- 'cooldown', 'tokens', 'requests' or 'tenant', whichever needs the longest
-- wait), {-1, 0, 'never'} when the request can never fit (tokens above a limit).

local id = ARGV[1]
local tokens = tonumber(ARGV[2])
local tokens_limit = tonumber(ARGV[3])
local requests_limit = tonumber(ARGV[4])
local tenant_limit = tonumber(ARGV[5])
local span = tonumber(ARGV[6]) + tonumber(ARGV[7])
local now = clock(ARGV[8])
local waiter = ARGV[9] or ''
local claim_ttl = tonumber(ARGV[10]) or 0
local held_claims = tonumber(ARGV[11]) or 0
local line, line_tokens, line_seen = KEYS[6], KEYS[7], KEYS[8]

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
    -- More than the whole log (claims ahead of it): try again when the log has emptied.
    if #entries > 0 then return math.max(0.001, tonumber(entries[#entries]) + span - now) end
    return span
end

local function leave_line(w)
    redis.call('ZREM', line, w)
    redis.call('ZREM', line_seen, w)
    redis.call('HDEL', line_tokens, w)
end

-- The same reservation id again: a retry of an attempt whose reply was lost
-- (Redis stalled past the client's timeout, then ran the script anyway). The
-- entry is already on the books and still in the window, so it is this
-- caller's: granted, nothing counted twice.
local held_score = redis.call('ZSCORE', KEYS[1], id)
if held_score and tonumber(held_score) > now - span then
    if waiter ~= '' then leave_line(waiter) end
    return {1, 0, ''}
end

local cooldown_ms = redis.call('PTTL', KEYS[5])
if cooldown_ms > 0 then
    -- A waiter keeps its place in line across a cooldown.
    if waiter ~= '' then redis.call('ZADD', line_seen, 'XX', now, waiter) end
    return {0, cooldown_ms, 'cooldown'}
end
if tokens > tokens_limit or (tenant_limit > 0 and tokens > tenant_limit) then
    if waiter ~= '' then leave_line(waiter) end
    return {-1, 0, 'never'}
end

-- Waiters not seen for claim_ttl_s have gone: their claims lapse.
if claim_ttl > 0 then
    local gone = redis.call('ZRANGEBYSCORE', line_seen, '-inf', now - claim_ttl)
    for _, w in ipairs(gone) do leave_line(w) end
end
-- Tokens claimed by the waiters ahead of this caller (all claims if it holds none):
-- the first held_claims waiters, as long as their claims fit in one limit together.
local held = 0
if held_claims > 0 then
    local head = redis.call('ZRANGE', line, 0, held_claims - 1)
    for _, w in ipairs(head) do
        if w == waiter then break end
        local claim = tonumber(redis.call('HGET', line_tokens, w)) or 0
        if held + claim > tokens_limit then break end
        held = held + claim
    end
end

expire_window(KEYS[1], KEYS[2], now, span)
local used = tonumber(redis.call('HGET', KEYS[2], '_tokens')) or 0
local requests = tonumber(redis.call('HGET', KEYS[2], '_requests')) or 0
local wait, reason = 0, ''
if used + tokens + held > tokens_limit then
    wait = wait_for(KEYS[1], KEYS[2], used + tokens + held - tokens_limit, false)
    reason = 'tokens'
end
if requests + 1 > requests_limit then
    local w = wait_for(KEYS[1], KEYS[2], requests + 1 - requests_limit, true)
    if w > wait then wait, reason = w, 'requests' end
end
local model_denied = wait > 0
local tenant_denied = false
if tenant_limit > 0 then
    expire_window(KEYS[3], KEYS[4], now, span)
    local tenant_used = tonumber(redis.call('HGET', KEYS[4], '_tokens')) or 0
    if tenant_used + tokens > tenant_limit then
        tenant_denied = true
        local w = wait_for(KEYS[3], KEYS[4], tenant_used + tokens - tenant_limit, false)
        if w >= wait then wait, reason = w, 'tenant' end
    end
end
if wait > 0 then
    if waiter ~= '' then
        if model_denied and not tenant_denied then
            -- Join the line (keeping the first denial's place) or stay in it.
            redis.call('ZADD', line, 'NX', now, waiter)
            redis.call('ZADD', line_seen, now, waiter)
            redis.call('HSET', line_tokens, waiter, tokens)
            local ttl_ms = math.ceil(claim_ttl * 2000)
            redis.call('PEXPIRE', line, ttl_ms)
            redis.call('PEXPIRE', line_seen, ttl_ms)
            redis.call('PEXPIRE', line_tokens, ttl_ms)
        else
            -- Waiting on its tenant's budget: it must not hold the model's capacity.
            leave_line(waiter)
        end
    end
    return {0, math.ceil(wait * 1000), reason}
end

if waiter ~= '' then leave_line(waiter) end
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
return {1, 0, ''}
