-- lib/window.lua: the sliding window log shared by the budget scripts.
--
-- A window is a log (zset: member -> the time it was granted) and an amounts
-- hash (member -> tokens, plus the running totals '_tokens' and '_requests').
-- Members starting with 'o:' are observations (budget_observe.lua): they hold
-- tokens but count as no request.
--
-- expire_window(log, amounts, now, span): drop the entries that left the
-- window (granted at or before now - span) and take them off the totals.
local function expire_window(log, amounts, now, span)
    local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - span)
    if #old == 0 then return end
    local tokens_freed, requests_freed = 0, 0
    for _, member in ipairs(old) do
        tokens_freed = tokens_freed + (tonumber(redis.call('HGET', amounts, member)) or 0)
        if string.sub(member, 1, 2) ~= 'o:' then requests_freed = requests_freed + 1 end
        redis.call('HDEL', amounts, member)
    end
    redis.call('ZREMRANGEBYSCORE', log, '-inf', now - span)
    -- (never pass -0: Redis does not read "-0" as an integer)
    if tokens_freed > 0 then redis.call('HINCRBY', amounts, '_tokens', -tokens_freed) end
    if requests_freed > 0 then redis.call('HINCRBY', amounts, '_requests', -requests_freed) end
end
