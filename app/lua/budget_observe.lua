-- The provider told us how many tokens it still has (x-ratelimit-remaining-tokens
-- or anthropic-ratelimit-tokens-remaining) and when that resets. When it has
-- less than we believe, charge the difference as an observation entry that
-- ages out when the provider's window resets, so our budget converges on the
-- provider's count (providers count tokens differently from tiktoken).
--
-- KEYS[1] model log  KEYS[2] model amounts
-- ARGV: id, provider_remaining, tokens_limit, reset_s, window_s, guard_s, now_s (optional)
-- Returns the tokens added (0 when the provider has at least what we think).

local remaining = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local reset_s = tonumber(ARGV[4])
local span = tonumber(ARGV[5]) + tonumber(ARGV[6])
local now
if ARGV[7] ~= nil and ARGV[7] ~= '' then
    now = tonumber(ARGV[7])
else
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- Entries that left the window first (as budget_reserve.lua does), so "used"
-- is what the window holds now.
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - span)
if #old > 0 then
    local tokens_freed, requests_freed = 0, 0
    for _, member in ipairs(old) do
        tokens_freed = tokens_freed + (tonumber(redis.call('HGET', KEYS[2], member)) or 0)
        if string.sub(member, 1, 2) ~= 'o:' then requests_freed = requests_freed + 1 end
        redis.call('HDEL', KEYS[2], member)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - span)
    if tokens_freed > 0 then redis.call('HINCRBY', KEYS[2], '_tokens', -tokens_freed) end
    if requests_freed > 0 then redis.call('HINCRBY', KEYS[2], '_requests', -requests_freed) end
end
local used = tonumber(redis.call('HGET', KEYS[2], '_tokens')) or 0
local ours = limit - used
local missing = ours - remaining
if missing <= 0 then return 0 end
-- Scored so that it leaves the window when the provider's counter resets.
local score = now - span + math.min(reset_s, span)
local member = 'o:' .. ARGV[1]
redis.call('ZADD', KEYS[1], score, member)
redis.call('HSET', KEYS[2], member, missing)
redis.call('HINCRBY', KEYS[2], '_tokens', missing)
return missing
