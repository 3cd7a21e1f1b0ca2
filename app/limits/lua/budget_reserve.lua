--! include clock
--! include window
-- Entering the gate, in one atomic step: a concurrency slot for the model (when
-- slot_limit > 0), tokens and one request against the model's budget, and
-- tokens against the tenant's own budget if it has one. All or nothing: a
-- caller denied by the budget takes no slot, one without a slot reserves nothing.
--
-- The reservation is prompt_est scaled by the model's learned ratio (ratio_of;
-- app/domain/rate_limits.py) plus `rest` (max_tokens), at most the limit.
--
-- Two shapes of the model's budget (the registry's limit_shape):
--   window: a sliding window log. Every reservation is a member of a sorted
--     set scored by its time; its tokens sit in a hash next to running totals.
--     It counts for window_s + guard_s seconds, so any window of window_s
--     seconds holds at most `limit` tokens even if a call reaches the provider
--     up to guard_s after it was admitted.
--   bucket: a token bucket of capacity `limit` refilled at limit / window_s per
--     second (one for tokens, one for requests), like OpenAI's limiter. Granted
--     iff the level holds the tokens and guard_s of refill besides (at most what
--     fits beside them: a full bucket grants anything up to its capacity); the
--     reservation is logged as in the window (to adopt a lost reply, refund it,
--     and read headers against it), but the log decides nothing.
-- The tenant's own tokens_per_min is always a window (our policy, not the
-- provider's limiter). Time is Redis's own clock (TIME), so skewed worker
-- clocks cannot overshoot; tests may pass now_s (slot leases always use TIME).
--
-- Fairness: a caller denied by the model's budget joins a line of waiters
-- (by a stable id per item, not per attempt), ordered by its first denial.
-- The first `held_claims` waiters (at most one limit of tokens together) hold
-- a claim on the tokens they asked for: any other reservation is granted only
-- if it leaves room for the claims ahead of it, so freed capacity (expired
-- window entries, or a bucket's refill) accumulates for a large request instead
-- of going to a stream of small ones. The first waiter has nothing ahead of it,
-- so the line always moves. A waiter's place lasts claim_ttl_s from its last
-- try, so a waiter that vanished frees its claim by itself.
--
-- KEYS[1] model log (zset)   KEYS[2] model amounts (hash)
-- KEYS[3] tenant log (zset)  KEYS[4] tenant amounts (hash)
-- KEYS[5] cooldown key (string with a TTL while the provider said 429)
-- KEYS[6] waiters (zset, score: first denial)  KEYS[7] waiters' tokens (hash)
-- KEYS[8] waiters (zset, score: last try)      KEYS[9] reservations' meta (hash)
-- KEYS[10] bucket levels (hash)  KEYS[11] learned ratios (hash)
-- KEYS[12] the model's concurrency slots (zset)  KEYS[13] the model's counters (hash)
-- KEYS[14] synchronous calls waiting for a slot (zset, score: when the claim lapses)
-- KEYS[15] the tenant of each slot holder (hash: holder -> 'tenant:weight', and
--          ':call' after it for a sync call)
-- KEYS[16] work asking for a slot (zset 'tenant:weight:item', score: lapse; a sync
--          call renews its entry by lua/call_demand.lua, other work when denied here)
-- ARGV: 1 id (one per item and attempt), 2 prompt_est, 3 rest, 4 tokens_limit,
--       5 requests_limit, 6 tenant_tokens_limit (0 = none), 7 window_s, 8 guard_s,
--       9 now_s (empty = Redis TIME), 10 waiter id (empty = none), 11 claim_ttl_s,
--       12 held_claims, 13 shape ('window' | 'bucket'), 14 model,
--       15 slot_limit (0 = take no slot), 16 slot_lease_s, 17 jitter u in [0, 1),
--       18 count (0: nothing, 1: budget denials and waits, 2: a slot denial too),
--       19..21 the counter fields: slot denials, budget denials, budget wait seconds,
--       22 urgent ('1': a synchronous call, someone waits on it), 23 its claim's ttl_s,
--       24 the ratio before the model's first sample,
--       25 the caller's tenant as 'tenant:weight' ('' = none), 26 a sync call's
--       tenant's share of the slots (app/domain/call_shares.py; 0 = no cap), 27 its
--       demand entry in KEYS[16] (added when denied a slot, dropped with the slot),
--       28 that entry's ttl_s
-- Returns {status, wait_ms, reason, tokens, prompt_part, countdown_s, held}: status 1
-- granted (tokens reserved, of which prompt_part is the scaled prompt; held: 1 if the
-- reservation was on the books before this call, plus 2 if its slot was), 0 denied
-- (reason 'cooldown', 'tokens', 'requests' or 'tenant', whichever needs the
-- longest wait; countdown_s = wait + jitter), -1 never (tokens above a limit),
-- 2 no free slot (reason 'slot'; 'share': the tenant's sync calls hold its share).

local id = ARGV[1]
local prompt_est = tonumber(ARGV[2]) or 0
local rest = tonumber(ARGV[3]) or 0
local tokens_limit = tonumber(ARGV[4])
local requests_limit = tonumber(ARGV[5])
local tenant_limit = tonumber(ARGV[6]) or 0
local window_s = tonumber(ARGV[7])
local guard_s = tonumber(ARGV[8])
local span = window_s + guard_s
local now = clock(ARGV[9])
local waiter = ARGV[10] or ''
local claim_ttl = tonumber(ARGV[11]) or 0
local held_claims = tonumber(ARGV[12]) or 0
local is_bucket = ARGV[13] == 'bucket'
local model = ARGV[14]
local slot_limit = tonumber(ARGV[15]) or 0
local slot_lease = tonumber(ARGV[16]) or 0
local jitter_u = tonumber(ARGV[17]) or 0
local count = tonumber(ARGV[18]) or 0
local log, amounts, tenant_log, tenant_amounts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local cooldown_key, line, line_tokens, line_seen = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local meta, bucket, ratios, slots, counters = KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local token_rate, request_rate = tokens_limit / window_s, requests_limit / window_s

-- A slot first: without one the caller neither reserves nor joins the line. A
-- synchronous call denied a slot claims the next one that frees: until it has it
-- (or its claim lapses: it went away), other work sees that many slots fewer.
local slot_now = slot_limit > 0 and clock() or 0
local urgent, callers = ARGV[22] == '1', KEYS[14]
local holders, demand = KEYS[15], KEYS[16]
local tenant_key, share = ARGV[25] or '', tonumber(ARGV[26]) or 0
local demand_entry, demand_ttl = ARGV[27] or '', tonumber(ARGV[28]) or 0
-- A sync call's tenant may hold at most its share of the slots with its sync calls
-- (its batch work counts in the share's demand, not against its calls: they still go
-- before it): over it, the call neither takes a slot nor claims the next one
-- (another tenant's work gets it). Holders whose lease ended no longer count.
local function tenant_of(key) return string.match(key, '^([^:]*)') end
if slot_limit > 0 and urgent and tenant_key ~= '' and share > 0
        and not redis.call('ZSCORE', slots, id) then
    local mine, held = tenant_of(tenant_key), 0
    local entries = redis.call('HGETALL', holders)
    for i = 1, #entries, 2 do
        local lease = redis.call('ZSCORE', slots, entries[i])
        if not lease or tonumber(lease) <= slot_now then
            redis.call('HDEL', holders, entries[i])
        elseif tenant_of(entries[i + 1]) == mine and string.sub(entries[i + 1], -5) == ':call' then
            held = held + 1
        end
    end
    if held >= share then
        redis.call('ZREM', callers, id)
        if count >= 2 then redis.call('HINCRBY', counters, ARGV[19], 1) end
        return {2, 0, 'share', 0, 0, ''}
    end
end
if slot_limit > 0 then
    redis.call('ZREMRANGEBYSCORE', callers, '-inf', slot_now)
    local claimed = 0
    if urgent then
        redis.call('ZREM', callers, id)
    else
        claimed = redis.call('ZCARD', callers)
    end
    if not slot_free(slots, id, slot_limit - claimed, slot_now) then
        -- Batch work denied a slot asks for one too: sync calls' shares count its tenant.
        if demand_entry ~= '' and demand_ttl > 0 then
            redis.call('ZADD', demand, slot_now + demand_ttl, demand_entry)
            redis.call('PEXPIRE', demand, math.ceil(demand_ttl * 2000))
        end
        if urgent then
            local ttl = tonumber(ARGV[23]) or 1
            redis.call('ZADD', callers, slot_now + ttl, id)
            redis.call('PEXPIRE', callers, math.ceil(ttl * 2000))
        end
        if count >= 2 then redis.call('HINCRBY', counters, ARGV[19], 1) end
        return {2, 0, 'slot', 0, 0, ''}
    end
end
-- Whether this id held its slot already (an earlier entry of the same attempt).
local slot_held = slot_limit > 0 and redis.call('ZSCORE', slots, id) and 2 or 0
local function take_slot()
    if slot_limit > 0 then redis.call('ZADD', slots, slot_now + slot_lease, id) end
    if slot_limit > 0 and tenant_key ~= '' then
        redis.call('HSET', holders, id, urgent and (tenant_key .. ':call') or tenant_key)
        redis.call('PEXPIRE', holders, math.ceil(slot_lease * 2000))
        if demand_entry ~= '' then redis.call('ZREM', demand, demand_entry) end
    end
end

local function leave_line(w)
    redis.call('ZREM', line, w)
    redis.call('ZREM', line_seen, w)
    redis.call('HDEL', line_tokens, w)
end

-- The same reservation id again: a retry of an attempt whose reply was lost
-- (Redis stalled past the client's timeout, then ran the script anyway), the
-- next message of an attempt whose worker died before its claim, or a duplicate
-- message of an attempt in flight. The entry is already on the books and still
-- in the window: granted, nothing counted twice, and the caller is told (held),
-- so that one whose claim then finds nothing leaves the entry to its owner. (A bucket's entry is re-dated: the
-- call happens now, and headers are read against its time.)
local held_score = redis.call('ZSCORE', log, id)
if held_score and tonumber(held_score) > now - span then
    if waiter ~= '' then leave_line(waiter) end
    if is_bucket and now > tonumber(held_score) then redis.call('ZADD', log, 'XX', now, id) end
    take_slot()
    local part = tonumber(string.match(redis.call('HGET', meta, id) or '', '^(%S+)')) or 0
    return {1, 0, '', tonumber(redis.call('HGET', amounts, id)) or 0, part, '', 1 + slot_held}
end

local function denied(wait, reason)
    local wait_ms = math.ceil(wait * 1000)
    local w = wait_ms / 1000
    local countdown = w + jitter_u * math.min(1.0, 0.1 * w + 0.05)
    if count >= 1 then
        redis.call('HINCRBY', counters, ARGV[20], 1)
        redis.call('HINCRBYFLOAT', counters, ARGV[21], num(countdown))
    end
    return {0, wait_ms, reason, 0, 0, num(countdown)}
end

local cooldown_ms = redis.call('PTTL', cooldown_key)
if cooldown_ms > 0 then
    -- A waiter keeps its place in line across a cooldown.
    if waiter ~= '' then redis.call('ZADD', line_seen, 'XX', now, waiter) end
    return denied(cooldown_ms / 1000, 'cooldown')
end
if prompt_est + rest > tokens_limit or (tenant_limit > 0 and prompt_est + rest > tenant_limit) then
    if waiter ~= '' then leave_line(waiter) end
    return {-1, 0, 'never', 0, 0, ''}
end

-- In the provider's count: the prompt scaled by the learned ratio, at most a limit.
local part = 0
if prompt_est > 0 then part = math.max(0, math.ceil(ratio_of(ratios, model, ARGV[24]) * prompt_est - 1e-9)) end
local tokens = part + rest
if tokens > tokens_limit then tokens = tokens_limit end
if tenant_limit > 0 and tokens > tenant_limit then tokens = tenant_limit end
part = tokens - rest

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

-- Window: seconds until `need` more tokens (or requests, when count_requests) are free.
local function wait_for(entries_log, entries_amounts, need, count_requests)
    local freed = 0
    local entries = redis.call('ZRANGE', entries_log, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
        local member = entries[i]
        if count_requests then
            if string.sub(member, 1, 2) ~= 'o:' then freed = freed + 1 end
        else
            freed = freed + (tonumber(redis.call('HGET', entries_amounts, member)) or 0)
        end
        if freed >= need then
            return tonumber(entries[i + 1]) + span - now
        end
    end
    -- More than the whole log (claims ahead of it): try again when the log has emptied.
    if #entries > 0 then return math.max(0.001, tonumber(entries[#entries]) + span - now) end
    return span
end

expire_window(log, amounts, now, span, meta)
local wait, reason = 0, ''
local token_level, request_level, bucket_now
if is_bucket then
    token_level, request_level, bucket_now =
        bucket_read(bucket, now, tokens_limit, token_rate, requests_limit, request_rate)
    -- guard_s of refill is kept in hand (as much as fits beside the request), for
    -- what the provider counts above our estimate and calls still on their way.
    local token_margin = math.min(token_rate * guard_s, math.max(0, tokens_limit - tokens))
    local request_margin = math.min(request_rate * guard_s, math.max(0, requests_limit - 1))
    if token_level - held - token_margin < tokens - 1e-9 then
        wait, reason = (tokens + held + token_margin - token_level) / token_rate, 'tokens'
    end
    if request_level - request_margin < 1 - 1e-9 then
        local w = (1 + request_margin - request_level) / request_rate
        if w > wait then wait, reason = w, 'requests' end
    end
else
    local used = tonumber(redis.call('HGET', amounts, '_tokens')) or 0
    local requests = tonumber(redis.call('HGET', amounts, '_requests')) or 0
    if used + tokens + held > tokens_limit then
        wait = wait_for(log, amounts, used + tokens + held - tokens_limit, false)
        reason = 'tokens'
    end
    if requests + 1 > requests_limit then
        local w = wait_for(log, amounts, requests + 1 - requests_limit, true)
        if w > wait then wait, reason = w, 'requests' end
    end
end
local model_denied = wait > 0
local tenant_denied = false
if tenant_limit > 0 then
    expire_window(tenant_log, tenant_amounts, now, span)
    local tenant_used = tonumber(redis.call('HGET', tenant_amounts, '_tokens')) or 0
    if tenant_used + tokens > tenant_limit then
        tenant_denied = true
        local w = wait_for(tenant_log, tenant_amounts, tenant_used + tokens - tenant_limit, false)
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
    return denied(wait, reason)
end

if waiter ~= '' then leave_line(waiter) end
local ttl_ms = math.ceil(span * 2000)
redis.call('ZADD', log, now, id)
redis.call('HSET', amounts, id, tokens)
if tokens > 0 then redis.call('HINCRBY', amounts, '_tokens', tokens) end
redis.call('HINCRBY', amounts, '_requests', 1)
redis.call('HSET', meta, id, part .. ' ' .. prompt_est)
redis.call('PEXPIRE', log, ttl_ms)
redis.call('PEXPIRE', amounts, ttl_ms)
redis.call('PEXPIRE', meta, ttl_ms)
if is_bucket then
    bucket_write(bucket, token_level - tokens, request_level - 1, bucket_now, tokens_limit,
        token_rate, span)
end
if tenant_limit > 0 then
    redis.call('ZADD', tenant_log, now, id)
    redis.call('HSET', tenant_amounts, id, tokens)
    if tokens > 0 then redis.call('HINCRBY', tenant_amounts, '_tokens', tokens) end
    redis.call('PEXPIRE', tenant_log, ttl_ms)
    redis.call('PEXPIRE', tenant_amounts, ttl_ms)
end
take_slot()
return {1, 0, '', tokens, part, '', slot_held}
