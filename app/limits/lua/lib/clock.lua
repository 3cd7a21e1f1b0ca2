-- lib/clock.lua: the time, in seconds, for the scripts that include it.
--
-- clock(arg): `arg` as a number when the caller passed one (tests pass now_s),
-- else Redis's own clock (TIME), so that skewed worker clocks play no part.
local function clock(arg)
    if arg ~= nil and arg ~= '' then
        return tonumber(arg)
    end
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
