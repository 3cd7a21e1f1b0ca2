--! include clock
--! include window
-- Settling a call, in one atomic step: free its concurrency slot, start the
-- cooldown a 429 asks for, add to the counters, reconcile or release its
-- reservation, hear the provider's rate-limit headers, learn the ratio.
-- (Budget.reconcile, .release, .observe and .cool_down run it for one part.)
--
-- Reservation (action): 'reconcile' sets it to what the provider charged:
-- `new_tokens` in the window shape; in the bucket shape its prompt part as
-- reserved (the provider's limiter counted the prompt its own way at admission)
-- plus `charged_rest` (max_tokens or the output), the difference going back to
-- (or coming out of) the bucket. 'release' drops it and gives everything back,
-- the request too. '' keeps it.
--
-- Headers (remaining_tokens / remaining_requests, received age_s ago):
--   window: compared with the window as it was when the header was received.
--     Less than we believe: the difference is charged as an observation entry
--     'o:<id>' that ages out when the provider's counter resets (reset_s,
--     counted from the header), so our budget converges on the provider's
--     count. More: our own observations are taken back (those that would hold
--     the budget longest first); reservations never are.
--   bucket: the provider had `remaining` right after the call we granted at the
--     reservation's time (anchor; without one: when the header was received),
--     so our level becomes min(capacity, remaining + rate * (now - anchor))
--     minus what we granted after the anchor (and in the send spread before it,
--     which may have reached the provider after that call): lowered or raised. The same for
--     requests. Two token headers far enough apart give a ratio sample: what
--     the provider consumed between them over what we estimated for the calls
--     we granted in between (app/domain/scheduling/rate_limits.py, interval_ratio_sample).
-- Ratio from the usage (window shape, or a bucket without token headers):
-- usage_prompt / prompt_est.
--
-- KEYS[1] model log  KEYS[2] model amounts  KEYS[3] tenant log  KEYS[4] tenant amounts
-- KEYS[5] reservations' meta  KEYS[6] bucket levels  KEYS[7] learned ratios
-- KEYS[8] cooldown  KEYS[9] the deployment's slots  KEYS[10] the model's counters
-- KEYS[11] the model's slots (every deployment's holders; KEYS[9] for a model of one)
-- KEYS[12] the deployment's circuit breaker (hash: n failures in the window since
--          `since`, `trips` in a row without a success)
-- KEYS[13] the model's slot holders' tenants (hash: holder -> tenant, for the shares)
-- KEYS[14] the budget's learned shape (read and written when shape is 'learn')
-- ARGV: 1 id, 2 shape ('window' | 'bucket' | 'learn': the one KEYS[14] holds), 3 action ('reconcile' | 'release' | ''), 4 new_tokens,
--       5 charged_rest ('' = new_tokens in both shapes), 6 tokens_limit,
--       7 requests_limit, 8 window_s, 9 guard_s, 10 now_s ('' = TIME),
--       11 remaining_tokens ('' = none), 12 remaining_requests ('' = none),
--       13 reset_tokens_s ('' = window_s), 14 age_s, 15 model,
--       16 usage prompt tokens ('' = none), 17 prompt_est ('' = none),
--       18 ratio weight, 19 ratio min, 20 ratio max, 21 ratio min calls,
--       22 cooldown_ms (0 = none), 23 counter fields to add one to (comma-separated),
--       24 release the slot ('1' | '0'), 25 the ratio before the model's first sample,
--       26 send spread s (bucket: calls granted this long before the header's call
--          may reach the provider after it, so they count as not yet seen),
--       27 breaker ('' nothing, 'ok' an answer, 'fail' a failure that points at the
--          deployment: app/domain/scheduling/pools.py), 28 failures that trip it, 29 its window s,
--       30 its first cooldown ms, 31 its longest cooldown ms,
--       32 what the headers say of the provider's shape ('window', 'bucket' or '';
--          app/domain/scheduling/rate_limits.py shape_evidence), 33 the headers in a row against
--          the learned shape that switch it (budget_shape_samples)
-- Returns {token change of the reservation (negative: a refund), tokens the
-- headers added to our count (negative: taken back / the level raised),
-- cooldown left in ms (0: none asked), the model's ratio, the breaker's cooldown
-- in ms (0: it did not trip)}.

local id = ARGV[1]
-- The shape: the registry's, or the learned one after this header's evidence (the
-- header is then read in the shape it leaves the budget in).
local is_bucket
if ARGV[2] == 'learn' then
    is_bucket = shape_learn(KEYS[14], ARGV[32] or '', tonumber(ARGV[33]) or 1)
else
    is_bucket = ARGV[2] == 'bucket'
end
local action = ARGV[3]
local new_tokens = tonumber(ARGV[4]) or 0
local charged_rest = tonumber(ARGV[5])
local tokens_limit = tonumber(ARGV[6])
local requests_limit = tonumber(ARGV[7])
local window_s = tonumber(ARGV[8])
local span = window_s + tonumber(ARGV[9])
local now = clock(ARGV[10])
local remaining_tokens = tonumber(ARGV[11])
local remaining_requests = tonumber(ARGV[12])
local reset_s = tonumber(ARGV[13]) or window_s
local age = math.max(0, tonumber(ARGV[14]) or 0)
local model = ARGV[15]
local usage_prompt = tonumber(ARGV[16])
local prompt_est = tonumber(ARGV[17])
local weight = tonumber(ARGV[18]) or 0
local ratio_low = tonumber(ARGV[19]) or 1
local ratio_high = tonumber(ARGV[20]) or 1
local min_calls = tonumber(ARGV[21]) or 1
local cooldown_ms = tonumber(ARGV[22]) or 0
local send_spread = math.max(0, tonumber(ARGV[26]) or 0)
local log, amounts, tenant_log, tenant_amounts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local meta, bucket, ratios, cooldown_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local token_rate, request_rate = tokens_limit / window_s, requests_limit / window_s

-- First what must happen whatever fails later (a script stopped by an error keeps
-- the writes it made): the slot, the cooldown, the counters.
if ARGV[24] == '1' then
    redis.call('ZREM', KEYS[9], id)
    if KEYS[11] ~= KEYS[9] then redis.call('ZREM', KEYS[11], id) end
    redis.call('HDEL', KEYS[13], id)  -- else it waits for a call's entry to prune it
end
local cooldown_left = 0
if cooldown_ms > 0 then cooldown_left = extend_cooldown(cooldown_key, cooldown_ms) end
-- The circuit breaker (app/domain/scheduling/pools.py breaker_trips, breaker_cooldown_s): an
-- answer closes it; breaker_failures failures within its window open it, and so does
-- one failure after a cooldown that no answer has followed yet. A failure while the
-- deployment cools down, or of a call granted before the last trip (sent before it,
-- ending after the cooldown), says nothing new.
local breaker, tripped_ms = ARGV[27] or '', 0
if breaker == 'ok' then
    redis.call('DEL', KEYS[12])
elseif breaker == 'fail' and redis.call('PTTL', cooldown_key) <= 0 then
    local b = redis.call('HMGET', KEYS[12], 'n', 'since', 'trips', 'tripped')
    local n, since, trips = tonumber(b[1]) or 0, tonumber(b[2]), tonumber(b[3]) or 0
    local last_trip, sent = tonumber(b[4]), tonumber(redis.call('ZSCORE', log, id))
    -- A reservation no longer in the log was granted over a window ago: before a trip
    -- made within the last window.
    if sent == nil and id ~= '' and last_trip and now - last_trip < span then
        sent = now - span
    end
    local longest_ms = tonumber(ARGV[31])
    if not (last_trip and sent and sent < last_trip) then
        if since == nil or now - since > tonumber(ARGV[29]) then n, since = 0, now end
        n = n + 1
        if trips > 0 or n >= tonumber(ARGV[28]) then
            trips = trips + 1
            tripped_ms = math.floor(math.min(longest_ms, tonumber(ARGV[30]) * 2 ^ (trips - 1)))
            extend_cooldown(cooldown_key, tripped_ms)
            n, since, last_trip = 0, now, now
        end
        redis.call('HSET', KEYS[12], 'n', n, 'since', num(since), 'trips', trips)
        if last_trip then redis.call('HSET', KEYS[12], 'tripped', num(last_trip)) end
    end
    redis.call('PEXPIRE', KEYS[12], math.ceil(2 * longest_ms + 1000 * tonumber(ARGV[29])))
end
for field in string.gmatch(ARGV[23] or '', '[^,]+') do
    redis.call('HINCRBY', KEYS[10], field, 1)
end

local function meta_of(member)
    local text = redis.call('HGET', meta, member)
    if not text then return 0, 0 end
    local part, est = string.match(text, '^(%S+) (%S+)$')
    return tonumber(part) or 0, tonumber(est) or 0
end

-- The reservation's time (nil: aged out of the log, or never made) and prompt part.
local granted_at = tonumber(redis.call('ZSCORE', log, id))
local part = meta_of(id)
local token_level, request_level, bucket_now
if is_bucket then
    token_level, request_level, bucket_now =
        bucket_read(bucket, now, tokens_limit, token_rate, requests_limit, request_rate)
end

-- The reservation's fate.
local delta = 0
local bucket_changed = false  -- (a settlement that changes nothing leaves the bucket alone)
local old = tonumber(redis.call('HGET', amounts, id))
if old ~= nil and action ~= '' then
    local amount = new_tokens
    if is_bucket and charged_rest ~= nil then amount = part + charged_rest end
    if action == 'release' then
        redis.call('HDEL', amounts, id)
        redis.call('HDEL', meta, id)
        redis.call('ZREM', log, id)
        if old > 0 then redis.call('HINCRBY', amounts, '_tokens', -old) end
        redis.call('HINCRBY', amounts, '_requests', -1)
        delta = -old
        bucket_changed = true
        if is_bucket then
            token_level = math.min(tokens_limit, token_level + old)
            request_level = math.min(requests_limit, request_level + 1)
        end
    else
        redis.call('HSET', amounts, id, amount)
        if amount ~= old then redis.call('HINCRBY', amounts, '_tokens', amount - old) end
        delta = amount - old
        bucket_changed = true
        if is_bucket then token_level = math.min(tokens_limit, token_level - delta) end
    end
    local tenant_old = tonumber(redis.call('HGET', tenant_amounts, id))
    if tenant_old ~= nil then
        if action == 'release' then
            redis.call('HDEL', tenant_amounts, id)
            redis.call('ZREM', tenant_log, id)
            if tenant_old > 0 then redis.call('HINCRBY', tenant_amounts, '_tokens', -tenant_old) end
        else
            redis.call('HSET', tenant_amounts, id, amount)
            if amount ~= tenant_old then
                redis.call('HINCRBY', tenant_amounts, '_tokens', amount - tenant_old)
            end
        end
    end
end

-- The headers.
local observed = 0
local header_ratio = false  -- a bucket learns its ratio from token headers, not usage
if (remaining_tokens ~= nil or remaining_requests ~= nil) and age < span then
    if not is_bucket and remaining_tokens ~= nil then
        local seen_at = now - age
        -- What the window held when the header was received: reservations granted
        -- up to then and still inside it then, and observations not yet reset then.
        local used = 0
        local entries = redis.call('ZRANGEBYSCORE', log, '(' .. num(seen_at - span), '+inf', 'WITHSCORES')
        for i = 1, #entries, 2 do
            local member = entries[i]
            if string.sub(member, 1, 2) == 'o:' or tonumber(entries[i + 1]) <= seen_at then
                used = used + (tonumber(redis.call('HGET', amounts, member)) or 0)
            end
        end
        expire_window(log, amounts, now, span, meta)
        local missing = tokens_limit - used - remaining_tokens
        -- Scored so that it leaves the window when the provider's counter resets.
        local score = seen_at - span + math.min(reset_s, span)
        if missing > 0 and score > now - span then
            local member = 'o:' .. id
            local before = tonumber(redis.call('HGET', amounts, member)) or 0
            redis.call('ZADD', log, score, member)
            redis.call('HSET', amounts, member, missing)
            if missing ~= before then
                redis.call('HINCRBY', amounts, '_tokens', missing - before)
            end
            redis.call('PEXPIRE', log, math.ceil(span * 2000))
            redis.call('PEXPIRE', amounts, math.ceil(span * 2000))
            observed = missing
        elseif missing < 0 then
            -- The provider has more than we believe: take our observations back.
            local excess = -missing
            local newest = redis.call('ZREVRANGEBYSCORE', log, '+inf', '(' .. num(now - span))
            for _, member in ipairs(newest) do
                if excess <= 0 then break end
                if string.sub(member, 1, 2) == 'o:' then
                    local amount = tonumber(redis.call('HGET', amounts, member)) or 0
                    local take = math.min(amount, excess)
                    if take >= amount then
                        redis.call('HDEL', amounts, member)
                        redis.call('ZREM', log, member)
                    else
                        redis.call('HSET', amounts, member, amount - take)
                    end
                    if take > 0 then redis.call('HINCRBY', amounts, '_tokens', -take) end
                    excess = excess - take
                    observed = observed - take
                end
            end
        end
    elseif is_bucket then
        bucket_changed = true
        local anchor = granted_at or (now - age)
        local since = math.max(0, bucket_now - anchor)
        -- What we granted after the anchor (or shortly before it, the send spread):
        -- the provider had not seen it yet.
        local after_tokens, after_requests = 0, 0
        local after = redis.call('ZRANGEBYSCORE', log, '(' .. num(anchor - send_spread), '+inf')
        for _, member in ipairs(after) do
            if member ~= id and string.sub(member, 1, 2) ~= 'o:' then
                after_tokens = after_tokens + (tonumber(redis.call('HGET', amounts, member)) or 0)
                after_requests = after_requests + 1
            end
        end
        if remaining_tokens ~= nil then
            local target = math.min(tokens_limit, remaining_tokens + token_rate * since)
                - after_tokens
            observed = token_level - target
            token_level = target
        end
        if remaining_requests ~= nil then
            request_level = math.min(requests_limit, remaining_requests + request_rate * since)
                - after_requests
        end
        -- A ratio sample from this header and the one the interval started at.
        if remaining_tokens ~= nil and weight > 0 then
            header_ratio = true
            local start = redis.call('HMGET', bucket, 'og', 'oR')
            local start_at, start_remaining = tonumber(start[1]), tonumber(start[2])
            if start_at == nil or anchor > start_at then
                local restart = true
                local elapsed = start_at and (anchor - start_at) or 0
                if start_at ~= nil and elapsed < span
                    and start_remaining + token_rate * elapsed < tokens_limit then
                    local calls, est_sum, rest_sum = 0, 0, 0
                    local between = redis.call('ZRANGEBYSCORE', log, '(' .. num(start_at), anchor)
                    for _, member in ipairs(between) do
                        if string.sub(member, 1, 2) ~= 'o:' then
                            local p, e = meta_of(member)
                            local amount = tonumber(redis.call('HGET', amounts, member)) or 0
                            calls = calls + 1
                            est_sum = est_sum + e
                            rest_sum = rest_sum + (amount - p)
                        end
                    end
                    if calls >= min_calls and est_sum > 0 then
                        local consumed = start_remaining + token_rate * elapsed - remaining_tokens
                        ratio_learn(ratios, model, (consumed - rest_sum) / est_sum, weight,
                            ratio_low, ratio_high)
                    else
                        restart = false  -- too little in between yet: let the interval grow
                    end
                end
                if restart then
                    redis.call('HSET', bucket, 'og', num(anchor), 'oR', num(remaining_tokens))
                end
            end
        end
    end
end
if is_bucket and bucket_changed then
    bucket_write(bucket, token_level, request_level, bucket_now, tokens_limit, token_rate, span)
end

-- The ratio from the answer's usage (the provider's own count of the prompt). A
-- bucket that sent a token header learns from headers alone, even from one that
-- came too late to read: its limiter counts its own way, which the usage need not
-- show (OpenAI's counts bytes, its usage tokens), and a usage sample taken while
-- the headers were late would pull the ratio to the usage's count.
if is_bucket and remaining_tokens ~= nil then header_ratio = true end
if not header_ratio and weight > 0 and usage_prompt ~= nil and prompt_est ~= nil
    and prompt_est >= 32 and usage_prompt > 0 then
    ratio_learn(ratios, model, usage_prompt / prompt_est, weight, ratio_low, ratio_high)
end

-- (Redis truncates a number in a reply: round the level's change to whole tokens)
return {delta, math.floor(observed + 0.5), cooldown_left, num(ratio_of(ratios, model, ARGV[25])),
    tripped_ms}
