--! include clock
-- An API key's own requests per minute (GCRA: a bucket of a minute's requests,
-- refilled steadily), one request at a time.
-- KEYS[1] the key's arrival time  ARGV: interval_ms (a minute / the limit),
-- burst_ms (a minute), now_s (empty = Redis TIME)
-- Returns 0 when the request may go, else the milliseconds until it may.
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = math.floor(clock(ARGV[3]) * 1000)
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then
    tat = now
end
local next_tat = tat + interval
if next_tat - now > burst then
    return next_tat - burst - now
end
redis.call('SET', KEYS[1], next_tat, 'PX', next_tat - now)
return 0
