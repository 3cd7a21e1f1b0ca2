--! include clock
--! include window
-- The provider told us how many tokens it still has (x-ratelimit-remaining-tokens
-- or anthropic-ratelimit-tokens-remaining) and when that resets. When it has
-- less than we believe, charge the difference as an observation entry that
-- ages out when the provider's window resets, so our budget converges on the
-- provider's count (providers count tokens differently from tiktoken).
--
-- The header was received age_s ago (a streamed call reads it at its start
-- and reports it at its end), so it is compared with the window as it was
-- then: entries that aged out since are not "missing" from the provider's
-- count, and the observation ages out when the provider's counter resets,
-- counted from the header, not from now.
--
-- KEYS[1] model log  KEYS[2] model amounts
-- ARGV: id, provider_remaining, tokens_limit, reset_s, window_s, guard_s,
--       now_s (optional), age_s (seconds since the header was received)
-- Returns the tokens added (0 when the provider has at least what we think).

local remaining = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local reset_s = tonumber(ARGV[4])
local span = tonumber(ARGV[5]) + tonumber(ARGV[6])
local now = clock(ARGV[7])
local age = math.max(0, tonumber(ARGV[8]) or 0)
local seen_at = now - age

-- What the window held when the header was received: reservations granted up
-- to then and still inside it then, and observations not yet reset then.
local used = 0
local entries = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (seen_at - span), '+inf', 'WITHSCORES')
for i = 1, #entries, 2 do
    local member = entries[i]
    if string.sub(member, 1, 2) == 'o:' or tonumber(entries[i + 1]) <= seen_at then
        used = used + (tonumber(redis.call('HGET', KEYS[2], member)) or 0)
    end
end

-- Entries that left the window (as budget_reserve.lua does).
expire_window(KEYS[1], KEYS[2], now, span)

local missing = limit - used - remaining
if missing <= 0 then return 0 end
-- Scored so that it leaves the window when the provider's counter resets.
local score = seen_at - span + math.min(reset_s, span)
if score <= now - span then return 0 end  -- the provider has reset since
local member = 'o:' .. ARGV[1]
local before = tonumber(redis.call('HGET', KEYS[2], member)) or 0
redis.call('ZADD', KEYS[1], score, member)
redis.call('HSET', KEYS[2], member, missing)
if missing ~= before then redis.call('HINCRBY', KEYS[2], '_tokens', missing - before) end
return missing
