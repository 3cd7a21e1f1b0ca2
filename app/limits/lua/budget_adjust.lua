-- Adjust a reservation to what the provider charged (reconcile), or drop it
-- entirely when the call never reached the provider (release).
--
-- KEYS[1] model log  KEYS[2] model amounts  KEYS[3] tenant log  KEYS[4] tenant amounts
-- ARGV: id, new_tokens (ignored when releasing), release ("1" or "0")
-- Returns the token difference applied (negative for a refund).

local id = ARGV[1]
local new_tokens = tonumber(ARGV[2])
local release = ARGV[3] == '1'

local function adjust(log, amounts, count_requests)
    local old = tonumber(redis.call('HGET', amounts, id))
    if old == nil then return 0 end  -- already aged out of the window
    if release then
        redis.call('HDEL', amounts, id)
        redis.call('ZREM', log, id)
        if old > 0 then redis.call('HINCRBY', amounts, '_tokens', -old) end
        if count_requests then redis.call('HINCRBY', amounts, '_requests', -1) end
        return -old
    end
    redis.call('HSET', amounts, id, new_tokens)
    if new_tokens ~= old then redis.call('HINCRBY', amounts, '_tokens', new_tokens - old) end
    return new_tokens - old
end

local delta = adjust(KEYS[1], KEYS[2], true)
adjust(KEYS[3], KEYS[4], false)
return delta
