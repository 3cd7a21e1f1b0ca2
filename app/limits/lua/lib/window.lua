-- lib/window.lua: the budget's bookkeeping shared by the gate's scripts: the
-- sliding window log, the token bucket, the learned ratio, cooldowns and slots.
-- (The pure Python twins of the arithmetic are in app/domain/scheduling/rate_limits.py.)
--
-- A window is a log (zset: member -> the time it was granted) and an amounts
-- hash (member -> tokens, plus the running totals '_tokens' and '_requests').
-- Members starting with 'o:' are observations (budget_settle.lua): they hold
-- tokens but count as no request. A bucket-shaped budget keeps the same log of
-- its reservations (to adopt a lost reply, to refund, to read headers against)
-- and its levels in a hash: 't' tokens, 'r' requests, at time 'ts'.
--
-- expire_window(log, amounts, now, span, meta): drop the entries that left the
-- window (granted at or before now - span) and take them off the totals; their
-- fields in the optional `meta` hash go too.
local function expire_window(log, amounts, now, span, meta)
    local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - span)
    if #old == 0 then return end
    local tokens_freed, requests_freed = 0, 0
    for _, member in ipairs(old) do
        tokens_freed = tokens_freed + (tonumber(redis.call('HGET', amounts, member)) or 0)
        if string.sub(member, 1, 2) ~= 'o:' then requests_freed = requests_freed + 1 end
        redis.call('HDEL', amounts, member)
        if meta then redis.call('HDEL', meta, member) end
    end
    redis.call('ZREMRANGEBYSCORE', log, '-inf', now - span)
    -- (never pass -0: Redis does not read "-0" as an integer)
    if tokens_freed > 0 then redis.call('HINCRBY', amounts, '_tokens', -tokens_freed) end
    if requests_freed > 0 then redis.call('HINCRBY', amounts, '_requests', -requests_freed) end
end

-- A number as Redis keeps it: all 17 digits, so a level read back is the same double.
local function num(x)
    return string.format('%.17g', x)
end

-- bucket_refill(level, last, now, capacity, rate): the level at `now` of a bucket
-- that held `level` at `last` (nil: never seen, so full), never above capacity.
local function bucket_refill(level, last, now, capacity, rate)
    if level == nil then return capacity end
    if last ~= nil and now > last then level = level + rate * (now - last) end
    if level > capacity then level = capacity end
    return level
end

-- bucket_read(key, now, tcap, trate, rcap, rrate) -> token level, request level, now.
-- A bucket's clock never goes back: an earlier `now` is read as its last update.
local function bucket_read(key, now, tcap, trate, rcap, rrate)
    local s = redis.call('HMGET', key, 't', 'r', 'ts')
    local last = tonumber(s[3])
    if last ~= nil and now < last then now = last end
    return bucket_refill(tonumber(s[1]), last, now, tcap, trate),
        bucket_refill(tonumber(s[2]), last, now, rcap, rrate), now
end

-- bucket_write(key, t, r, now, tcap, trate, span): keep the levels until the bucket
-- would be full again (and a window at least): a bucket that expired is full.
local function bucket_write(key, t, r, now, tcap, trate, span)
    redis.call('HSET', key, 't', num(t), 'r', num(r), 'ts', num(now))
    local full_s = math.max(0, (tcap - t) / trate)
    redis.call('PEXPIRE', key, math.ceil((full_s + 2 * span) * 1000))
end

-- ratio_of(key, model, start): the learned ratio of the provider's prompt count to
-- ours; `start` (a number or its text; 1 if absent) until the first sample.
local function ratio_of(key, model, start)
    return tonumber(redis.call('HGET', key, model)) or tonumber(start) or 1.0
end

-- ratio_learn(key, model, sample, weight, low, high): the first sample, clamped to
-- [low, high], becomes the ratio; each later one moves it by `weight` of the
-- difference (the result clamped too). Returns the ratio (nil: none learned yet).
local function ratio_learn(key, model, sample, weight, low, high)
    local learned = tonumber(redis.call('HGET', key, model))
    if sample ~= sample or sample == math.huge or sample == -math.huge then return learned end
    sample = math.max(low, math.min(high, sample))
    local ratio = sample
    if learned ~= nil then ratio = math.max(low, math.min(high, learned + weight * (sample - learned))) end
    redis.call('HSET', key, model, num(ratio))
    redis.call('HINCRBY', key, model .. ':n', 1)
    redis.call('PEXPIRE', key, 7 * 86400 * 1000)  -- unused for a week: learnt afresh
    return ratio
end

-- extend_cooldown(key, ms): deny the budget for ms milliseconds, keeping the longer
-- of an existing and the new cooldown. Returns the cooldown left (ms; -1: set by
-- hand without an expiry, left alone).
local function extend_cooldown(key, ms)
    local current = redis.call('PTTL', key)
    if current == -1 then return -1 end
    if current < ms then
        redis.call('SET', key, '1', 'PX', ms)
        return ms
    end
    return current
end

-- slot_free(key, holder, limit, now): whether `holder` has or may take one of
-- `limit` slots (leases that ended are dropped first). Takes nothing.
local function slot_free(key, holder, limit, now)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if redis.call('ZSCORE', key, holder) then return true end
    return redis.call('ZCARD', key) < limit
end

-- A budget whose registry entry sets no limit_shape (shape 'learn') is kept in the
-- shape learned from the provider's reset headers, in hash `key`: 'shape' ('window'
-- or 'bucket'; absent: a bucket) and 'n', the headers in a row that said otherwise.
-- is_bucket_shape(shape, key): whether a budget of the registry's `shape` is a bucket.
local function is_bucket_shape(shape, key)
    if shape == 'learn' then return redis.call('HGET', key, 'shape') ~= 'window' end
    return shape == 'bucket'
end

-- shape_learn(key, evidence, switch_after): one header's evidence ('window', 'bucket'
-- or '') applied (app/domain/scheduling/rate_limits.py next_shape): one for the kept shape resets
-- the count, switch_after in a row against it switch it. Returns whether it is a bucket.
local function shape_learn(key, evidence, switch_after)
    local s = redis.call('HMGET', key, 'shape', 'n')
    local current, against = s[1] or 'bucket', tonumber(s[2]) or 0
    if evidence == 'window' or evidence == 'bucket' then
        if evidence == current then
            against = 0
        else
            against = against + 1
            if against >= math.max(1, switch_after) then current, against = evidence, 0 end
        end
        redis.call('HSET', key, 'shape', current, 'n', against)
        redis.call('PEXPIRE', key, 7 * 86400 * 1000)  -- unused for a week: learnt afresh
    end
    return current == 'bucket'
end
