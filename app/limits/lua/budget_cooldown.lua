-- After a 429: deny every reservation on this budget for ms milliseconds,
-- keeping the longer of an existing and the new cooldown, in one atomic step
-- (a short cooldown must never overwrite a longer one set meanwhile).
--
-- KEYS[1] cooldown key   ARGV: ms
-- Returns the cooldown left in milliseconds after the call.

local ms = tonumber(ARGV[1])
local current = redis.call('PTTL', KEYS[1])
if current == -1 then
    return -1  -- set without an expiry by hand: leave it alone
end
if current < ms then
    redis.call('SET', KEYS[1], '1', 'PX', ms)
    return ms
end
return current
