--! include clock
--! include window
-- Entering the gate, in one atomic step: a concurrency slot and a budget
-- reservation on one of the model's deployments (a model that declares none has
-- one, made of its own fields), tokens against the tenant's own budget if it has
-- one. All or nothing: a caller denied by the budget takes no slot, one without a
-- slot reserves nothing.
--
-- Deployments (app/registry.py Deployment): each has its own budget (keys by its
-- budget_key), limits, limit shape and slots. The script looks at every one and
-- takes the call on the one app/domain/scheduling/pools.py pick() prefers among those with
-- room now: one the item did not just fail on ('avoided') first, then the most
-- headroom (the smallest share of its token, request and slot limits left after
-- the call), then the first listed. Nothing is reserved anywhere else, so no
-- deployment can be overshot. The model's own slots (KEYS[7]) hold every
-- deployment's holders together, with the model's total as their limit: the sync
-- calls' shares and claims below count on them. A model of one deployment uses
-- that one set of slots, and everything happens as on a single budget.
--
-- The reservation is prompt_est scaled by the deployment's learned ratio (ratio_of;
-- app/domain/scheduling/rate_limits.py) plus `rest` (max_tokens), at most the limit.
--
-- Two shapes of a deployment's budget (the registry's limit_shape; one that sets
-- none is kept in the shape learned from the provider's headers, budget_settle.lua):
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
-- Fairness: a caller denied by the budgets joins the line of waiters (by a
-- stable id per item, not per attempt) of the deployment it would wait least
-- for, ordered by its first denial. The first `held_claims` waiters of a line (at
-- most one limit of tokens together) hold a claim on the tokens they asked for:
-- any other reservation there is granted only if it leaves room for the claims
-- ahead of it, so freed capacity (expired window entries, or a bucket's refill)
-- accumulates for a large request instead of going to a stream of small ones.
-- The first waiter has nothing ahead of it, so the line always moves. A waiter's
-- place lasts claim_ttl_s from its last try, so a waiter that vanished frees its
-- claim by itself.
--
-- KEYS[1] tenant log (zset)  KEYS[2] tenant amounts (hash)
-- KEYS[3] the model's counters (hash)
-- KEYS[4] synchronous calls waiting for a slot (zset, score: when the claim lapses)
-- KEYS[5] the tenant of each slot holder (hash: holder -> 'tenant:weight', and
--         ':call' after it for a sync call)
-- KEYS[6] work asking for a slot (zset 'tenant:weight:item', score: lapse; a sync
--         call renews its entry by lua/call_demand.lua, other work when denied here)
-- KEYS[7] the model's concurrency slots (zset, score: lease end; every deployment's)
-- then eleven keys for each deployment: log (zset), amounts (hash), cooldown (string
--   with a TTL while the provider said 429 or the breaker is open), waiters (zset,
--   score: first denial), waiters' tokens (hash), waiters (zset, score: last try),
--   reservations' meta (hash), bucket levels (hash), learned ratios (hash), its
--   slots (zset; the model's own for a model of one deployment), its learned shape
--   (hash, lib/window.lua is_bucket_shape)
-- ARGV: 1 id (one per item and attempt), 2 prompt_est, 3 rest, 4 tenant_tokens_limit
--       (0 = none), 5 window_s, 6 guard_s, 7 now_s (empty = Redis TIME), 8 waiter id
--       (empty = none), 9 claim_ttl_s, 10 held_claims, 11 model, 12 the model's slot
--       limit (0 = take no slot), 13 slot_lease_s, 14 jitter u in [0, 1), 15 count
--       (0: nothing, 1: budget denials and waits, 2: a slot denial too), 16..18 the
--       counter fields: slot denials, budget denials, budget wait seconds, 19 urgent
--       ('1': a synchronous call, someone waits on it), 20 its claim's ttl_s, 21 the
--       ratio before a deployment's first sample, 22 the caller's tenant as
--       'tenant:weight' ('' = none), 23 a sync call's tenant's share of the slots
--       (app/domain/scheduling/call_shares.py; 0 = no cap), 24 its demand entry in KEYS[6]
--       (added when denied a slot, dropped with the slot), 25 that entry's ttl_s,
--       26 the number of deployments,
--       then five for each deployment: tokens_limit, requests_limit, shape
--       ('window' | 'bucket' | 'learn': the learned one), slot limit, avoided ('1': the item's last call failed
--       there).
-- then, last of all (read from the end, apart from the rest): KEYS[#KEYS - 1] the
--   model's recent-calls mark (string, with a TTL of recent_s from a sync call's last
--   entry), KEYS[#KEYS] the gate's state marker (app/limits/gate_state.py);
--   ARGV[#ARGV - 2] the calls' reserve of the model's slots (0 = none; at most the
--   slot limit less one), ARGV[#ARGV - 1] recent_s, ARGV[#ARGV] '1' when the marker
--   must be there (a gate that rebuilds lost state: app/worker/gate_recovery.py).
-- Returns {status, wait_ms, reason, tokens, prompt_part, countdown_s, held, deployment}:
-- status 1 granted on deployment (1-based; tokens reserved, of which prompt_part is
-- the scaled prompt; held: 1 if the reservation was on the books before this call,
-- plus 2 if its slot was), 0 denied (reason 'cooldown', 'tokens', 'requests' or
-- 'tenant' of the deployment with the shortest wait; countdown_s = wait + jitter),
-- -1 never (tokens above the limits of every deployment), 2 no free slot (reason
-- 'slot'; 'share': the tenant's sync calls hold its share), 3 the gate's state
-- marker is missing (reason 'state': Redis lost the budgets and slots this would be
-- measured against; nothing taken, the caller rebuilds them first).

local id = ARGV[1]
local prompt_est = tonumber(ARGV[2]) or 0
local rest = tonumber(ARGV[3]) or 0
local tenant_limit = tonumber(ARGV[4]) or 0
local window_s = tonumber(ARGV[5])
local guard_s = tonumber(ARGV[6])
local span = window_s + guard_s
local now = clock(ARGV[7])
local waiter = ARGV[8] or ''
local claim_ttl = tonumber(ARGV[9]) or 0
local held_claims = tonumber(ARGV[10]) or 0
local model = ARGV[11]
local slot_limit = tonumber(ARGV[12]) or 0
local slot_lease = tonumber(ARGV[13]) or 0
local jitter_u = tonumber(ARGV[14]) or 0
local count = tonumber(ARGV[15]) or 0
local urgent = ARGV[19] == '1'
local tenant_key, share = ARGV[22] or '', tonumber(ARGV[23]) or 0
local demand_entry, demand_ttl = ARGV[24] or '', tonumber(ARGV[25]) or 0
local tenant_log, tenant_amounts, counters = KEYS[1], KEYS[2], KEYS[3]
local callers, holders, demand, slots = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local calls_seen, state_marker = KEYS[#KEYS - 1], KEYS[#KEYS]
local reserve, recent_s = tonumber(ARGV[#ARGV - 2]) or 0, tonumber(ARGV[#ARGV - 1]) or 0

-- Budgets and slots that Redis lost (a failover, a restart empty, FLUSHALL) would
-- admit anything: a gate that rebuilds them refuses until they are (the marker).
if ARGV[#ARGV] == '1' and redis.call('EXISTS', state_marker) == 0 then
    return {3, 0, 'state', 0, 0, ''}
end

-- The deployments, in the registry's order.
local pool = {}
for i = 1, tonumber(ARGV[26]) do
    local k, a = 7 + (i - 1) * 11, 26 + (i - 1) * 5
    local d = {
        index = i, log = KEYS[k + 1], amounts = KEYS[k + 2], cooldown = KEYS[k + 3],
        line = KEYS[k + 4], line_tokens = KEYS[k + 5], line_seen = KEYS[k + 6],
        meta = KEYS[k + 7], bucket = KEYS[k + 8], ratios = KEYS[k + 9], slots = KEYS[k + 10],
        tokens_limit = tonumber(ARGV[a + 1]), requests_limit = tonumber(ARGV[a + 2]),
        is_bucket = is_bucket_shape(ARGV[a + 3], KEYS[k + 11]), slot_limit = tonumber(ARGV[a + 4]) or 0,
        avoided = ARGV[a + 5] == '1',
    }
    d.token_rate, d.request_rate = d.tokens_limit / window_s, d.requests_limit / window_s
    pool[i] = d
end

-- A slot first: without one the caller neither reserves nor joins a line. A
-- synchronous call denied a slot claims the next one that frees: until it has it
-- (or its claim lapses: it went away), other work sees that many slots fewer.
local slot_now = slot_limit > 0 and clock() or 0
-- A sync call's tenant may hold at most its share of the slots with its sync calls
-- (its batch work counts in the share's demand, not against its calls: they still go
-- before it): over it, the call neither takes a slot nor claims the next one
-- (another tenant's work gets it). Holders whose lease ended no longer count.
local function tenant_of(key) return string.match(key, '^([^:]*)') end
local function is_call(key) return string.sub(key, -5) == ':call' end
-- The holders' 'tenant:weight[:call]' whose slot lease has not ended (the others are
-- dropped from the hash).
local function live_holders()
    local live = {}
    local entries = redis.call('HGETALL', holders)
    for i = 1, #entries, 2 do
        local lease = redis.call('ZSCORE', slots, entries[i])
        if not lease or tonumber(lease) <= slot_now then
            redis.call('HDEL', holders, entries[i])
        else
            live[#live + 1] = entries[i + 1]
        end
    end
    return live
end
-- The calls' reserve: a sync call marks the model as called recently (see below).
if slot_limit > 0 and urgent and recent_s > 0 then
    redis.call('SET', calls_seen, '1', 'PX', math.ceil(recent_s * 1000))
end
if slot_limit > 0 and urgent and tenant_key ~= '' and share > 0
        and not redis.call('ZSCORE', slots, id) then
    local mine, held = tenant_of(tenant_key), 0
    for _, holder in ipairs(live_holders()) do
        if tenant_of(holder) == mine and is_call(holder) then held = held + 1 end
    end
    if held >= share then
        redis.call('ZREM', callers, id)
        if count >= 2 then redis.call('HINCRBY', counters, ARGV[16], 1) end
        return {2, 0, 'share', 0, 0, ''}
    end
end
local function slot_denied()
    -- Batch work denied a slot asks for one too: sync calls' shares count its tenant.
    if demand_entry ~= '' and demand_ttl > 0 then
        redis.call('ZADD', demand, slot_now + demand_ttl, demand_entry)
        redis.call('PEXPIRE', demand, math.ceil(demand_ttl * 2000))
    end
    if urgent then
        local ttl = tonumber(ARGV[20]) or 1
        redis.call('ZADD', callers, slot_now + ttl, id)
        redis.call('PEXPIRE', callers, math.ceil(ttl * 2000))
    end
    if count >= 2 then redis.call('HINCRBY', counters, ARGV[16], 1) end
    return {2, 0, 'slot', 0, 0, ''}
end
-- The calls' reserve (app/domain/scheduling/call_reserve.py slots_withheld): what other work
-- leaves the sync calls. A slot for each call waiting (its claim) and, while a call
-- entered in the last recent_s (the mark), the reserve less the slots calls hold: the
-- next call starts at once behind a backlog. Without recent calls, nothing more.
local function withheld_from_work(waiting)
    if reserve <= 0 or redis.call('EXISTS', calls_seen) == 0 then return waiting end
    local calls = 0
    for _, holder in ipairs(live_holders()) do
        if is_call(holder) then calls = calls + 1 end
    end
    return math.max(waiting, reserve - calls)
end
if slot_limit > 0 then
    redis.call('ZREMRANGEBYSCORE', callers, '-inf', slot_now)
    local withheld = 0
    if urgent then
        redis.call('ZREM', callers, id)
    else
        withheld = withheld_from_work(redis.call('ZCARD', callers))
    end
    if not slot_free(slots, id, slot_limit - withheld, slot_now) then return slot_denied() end
end
-- Whether this id held its slot already (an earlier entry of the same attempt).
local slot_held = slot_limit > 0 and redis.call('ZSCORE', slots, id) and 2 or 0
-- A deployment's own slot is free (a model of one deployment: checked above).
local function own_slot_free(d)
    return slot_limit <= 0 or d.slots == slots or slot_free(d.slots, id, d.slot_limit, slot_now)
end
local function take_slot(d)
    if slot_limit > 0 then
        redis.call('ZADD', slots, slot_now + slot_lease, id)
        if d.slots ~= slots then
            redis.call('ZADD', d.slots, slot_now + slot_lease, id)
            redis.call('PEXPIRE', d.slots, math.ceil(slot_lease * 2000))
        end
    end
    if slot_limit > 0 and tenant_key ~= '' then
        redis.call('HSET', holders, id, urgent and (tenant_key .. ':call') or tenant_key)
        redis.call('PEXPIRE', holders, math.ceil(slot_lease * 2000))
        if demand_entry ~= '' then redis.call('ZREM', demand, demand_entry) end
    end
end

local function leave_line(d, w)
    redis.call('ZREM', d.line, w)
    redis.call('ZREM', d.line_seen, w)
    redis.call('HDEL', d.line_tokens, w)
end
local function leave_lines(except)
    if waiter == '' then return end
    for _, d in ipairs(pool) do
        if d ~= except then leave_line(d, waiter) end
    end
end

-- The same reservation id again: a retry of an attempt whose reply was lost
-- (Redis stalled past the client's timeout, then ran the script anyway), the
-- next message of an attempt whose worker died before its claim, or a duplicate
-- message of an attempt in flight. The entry is already on the books (of the
-- deployment that granted it) and still in the window: granted there, nothing
-- counted twice, and the caller is told (held), so that one whose claim then finds
-- nothing leaves the entry to its owner. (A bucket's entry is re-dated: the call
-- happens now, and headers are read against its time.)
for _, d in ipairs(pool) do
    local held_score = redis.call('ZSCORE', d.log, id)
    if held_score and tonumber(held_score) > now - span then
        if not own_slot_free(d) then return slot_denied() end
        leave_lines(nil)
        if d.is_bucket and now > tonumber(held_score) then
            redis.call('ZADD', d.log, 'XX', now, id)
        end
        take_slot(d)
        local part = tonumber(string.match(redis.call('HGET', d.meta, id) or '', '^(%S+)')) or 0
        local amount = tonumber(redis.call('HGET', d.amounts, id)) or 0
        return {1, 0, '', amount, part, '', 1 + slot_held, d.index}
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

if tenant_limit > 0 then expire_window(tenant_log, tenant_amounts, now, span) end
local tenant_used = tonumber(redis.call('HGET', tenant_amounts, '_tokens')) or 0

-- One deployment as this call would find it: its state ('cooldown', 'never', 'wait',
-- 'slot' or 'fits'), the wait and its reason, the tokens it would reserve, and what
-- it would have left (app/domain/scheduling/pools.py headroom).
local function look(d)
    local cooldown_ms = redis.call('PTTL', d.cooldown)
    if cooldown_ms > 0 then
        d.state, d.wait, d.reason = 'cooldown', cooldown_ms / 1000, 'cooldown'
        return
    end
    if prompt_est + rest > d.tokens_limit or (tenant_limit > 0 and prompt_est + rest > tenant_limit) then
        d.state = 'never'
        return
    end
    -- In the provider's count: the prompt scaled by the learned ratio, at most a limit.
    local part = 0
    if prompt_est > 0 then
        part = math.max(0, math.ceil(ratio_of(d.ratios, model, ARGV[21]) * prompt_est - 1e-9))
    end
    local tokens = part + rest
    if tokens > d.tokens_limit then tokens = d.tokens_limit end
    if tenant_limit > 0 and tokens > tenant_limit then tokens = tenant_limit end
    d.tokens, d.part = tokens, tokens - rest

    -- Waiters not seen for claim_ttl_s have gone: their claims lapse.
    if claim_ttl > 0 then
        local gone = redis.call('ZRANGEBYSCORE', d.line_seen, '-inf', now - claim_ttl)
        for _, w in ipairs(gone) do leave_line(d, w) end
    end
    -- Tokens claimed by the waiters ahead of this caller (all claims if it holds none):
    -- the first held_claims waiters, as long as their claims fit in one limit together.
    local held = 0
    if held_claims > 0 then
        local head = redis.call('ZRANGE', d.line, 0, held_claims - 1)
        for _, w in ipairs(head) do
            if w == waiter then break end
            local claim = tonumber(redis.call('HGET', d.line_tokens, w)) or 0
            if held + claim > d.tokens_limit then break end
            held = held + claim
        end
    end

    expire_window(d.log, d.amounts, now, span, d.meta)
    local wait, reason = 0, ''
    if d.is_bucket then
        d.token_level, d.request_level, d.bucket_now = bucket_read(d.bucket, now,
            d.tokens_limit, d.token_rate, d.requests_limit, d.request_rate)
        -- guard_s of refill is kept in hand (as much as fits beside the request), for
        -- what the provider counts above our estimate and calls still on their way.
        local token_margin = math.min(d.token_rate * guard_s, math.max(0, d.tokens_limit - tokens))
        local request_margin = math.min(d.request_rate * guard_s, math.max(0, d.requests_limit - 1))
        if d.token_level - held - token_margin < tokens - 1e-9 then
            wait, reason = (tokens + held + token_margin - d.token_level) / d.token_rate, 'tokens'
        end
        if d.request_level - request_margin < 1 - 1e-9 then
            local w = (1 + request_margin - d.request_level) / d.request_rate
            if w > wait then wait, reason = w, 'requests' end
        end
        d.free_tokens = d.token_level - held - tokens
        d.free_requests = d.request_level - 1
    else
        local used = tonumber(redis.call('HGET', d.amounts, '_tokens')) or 0
        local requests = tonumber(redis.call('HGET', d.amounts, '_requests')) or 0
        if used + tokens + held > d.tokens_limit then
            wait = wait_for(d.log, d.amounts, used + tokens + held - d.tokens_limit, false)
            reason = 'tokens'
        end
        if requests + 1 > d.requests_limit then
            local w = wait_for(d.log, d.amounts, requests + 1 - d.requests_limit, true)
            if w > wait then wait, reason = w, 'requests' end
        end
        d.free_tokens = d.tokens_limit - used - held - tokens
        d.free_requests = d.requests_limit - requests - 1
    end
    d.model_denied = wait > 0
    d.tenant_denied = false
    if tenant_limit > 0 and tenant_used + tokens > tenant_limit then
        d.tenant_denied = true
        local w = wait_for(tenant_log, tenant_amounts, tenant_used + tokens - tenant_limit, false)
        if w >= wait then wait, reason = w, 'tenant' end
    end
    if wait > 0 then
        d.state, d.wait, d.reason = 'wait', wait, reason
    elseif not own_slot_free(d) then
        d.state = 'slot'
    else
        d.state = 'fits'
    end
end

-- app/domain/scheduling/pools.py headroom(): the smallest share of its limits left after the call.
local function headroom(d)
    local h = math.min(d.free_tokens / math.max(1, d.tokens_limit),
        d.free_requests / math.max(1, d.requests_limit))
    if slot_limit > 0 and d.slot_limit > 0 then
        local free = d.slot_limit - redis.call('ZCOUNT', d.slots, '(' .. slot_now, '+inf') - 1
        h = math.min(h, free / d.slot_limit)
    end
    return h
end

-- app/domain/scheduling/pools.py pick(): not avoided first, then the most headroom, then the first.
local best, best_avoided, best_room = nil, true, 0
local nearest, any_slot, all_never = nil, false, true
for _, d in ipairs(pool) do
    look(d)
    if d.state ~= 'never' then all_never = false end
    if d.state == 'slot' then any_slot = true end
    if d.state == 'fits' then
        local room = headroom(d)
        if best == nil or (best_avoided and not d.avoided)
                or (best_avoided == d.avoided and room > best_room) then
            best, best_avoided, best_room = d, d.avoided, room
        end
    elseif (d.state == 'wait' or d.state == 'cooldown') and (nearest == nil or d.wait < nearest.wait) then
        nearest = d
    end
end

local function denied(wait, reason)
    local wait_ms = math.ceil(wait * 1000)
    local w = wait_ms / 1000
    local countdown = w + jitter_u * math.min(1.0, 0.1 * w + 0.05)
    if count >= 1 then
        redis.call('HINCRBY', counters, ARGV[17], 1)
        redis.call('HINCRBYFLOAT', counters, ARGV[18], num(countdown))
    end
    return {0, wait_ms, reason, 0, 0, num(countdown)}
end

if best == nil then
    if any_slot then return slot_denied() end
    if all_never then
        leave_lines(nil)
        return {-1, 0, 'never', 0, 0, ''}
    end
    local d = nearest
    if waiter ~= '' then
        leave_lines(d)
        if d.state == 'cooldown' then
            -- A waiter keeps its place in line across a cooldown.
            redis.call('ZADD', d.line_seen, 'XX', now, waiter)
        elseif d.model_denied and not d.tenant_denied then
            -- Join the line (keeping the first denial's place) or stay in it.
            redis.call('ZADD', d.line, 'NX', now, waiter)
            redis.call('ZADD', d.line_seen, now, waiter)
            redis.call('HSET', d.line_tokens, waiter, d.tokens)
            local ttl_ms = math.ceil(claim_ttl * 2000)
            redis.call('PEXPIRE', d.line, ttl_ms)
            redis.call('PEXPIRE', d.line_seen, ttl_ms)
            redis.call('PEXPIRE', d.line_tokens, ttl_ms)
        else
            -- Waiting on its tenant's budget: it must not hold the deployment's capacity.
            leave_line(d, waiter)
        end
    end
    return denied(d.wait, d.reason)
end

local d, tokens = best, best.tokens
leave_lines(nil)
local ttl_ms = math.ceil(span * 2000)
redis.call('ZADD', d.log, now, id)
redis.call('HSET', d.amounts, id, tokens)
if tokens > 0 then redis.call('HINCRBY', d.amounts, '_tokens', tokens) end
redis.call('HINCRBY', d.amounts, '_requests', 1)
redis.call('HSET', d.meta, id, d.part .. ' ' .. prompt_est)
redis.call('PEXPIRE', d.log, ttl_ms)
redis.call('PEXPIRE', d.amounts, ttl_ms)
redis.call('PEXPIRE', d.meta, ttl_ms)
if d.is_bucket then
    bucket_write(d.bucket, d.token_level - tokens, d.request_level - 1, d.bucket_now,
        d.tokens_limit, d.token_rate, span)
end
if tenant_limit > 0 then
    redis.call('ZADD', tenant_log, now, id)
    redis.call('HSET', tenant_amounts, id, tokens)
    if tokens > 0 then redis.call('HINCRBY', tenant_amounts, '_tokens', tokens) end
    redis.call('PEXPIRE', tenant_log, ttl_ms)
    redis.call('PEXPIRE', tenant_amounts, ttl_ms)
end
take_slot(d)
return {1, 0, '', tokens, d.part, '', slot_held, d.index}
