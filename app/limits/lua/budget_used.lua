--! include clock
-- Tokens and requests reserved in the current window, read-only, on Redis's
-- clock: entries that left the window count no more even when no reservation
-- has expired them yet (for status and metrics).
--
-- KEYS[1] model log  KEYS[2] model amounts
-- ARGV: window_s, guard_s, now_s (empty = Redis TIME)
-- Returns {tokens, requests}.

local span = tonumber(ARGV[1]) + tonumber(ARGV[2])
local now = clock(ARGV[3])
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now - span), '+inf')
local tokens, requests = 0, 0
for _, member in ipairs(members) do
    tokens = tokens + (tonumber(redis.call('HGET', KEYS[2], member)) or 0)
    if string.sub(member, 1, 2) ~= 'o:' then requests = requests + 1 end
end
return {tokens, requests}
