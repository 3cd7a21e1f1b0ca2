--! include clock
--! include window
-- Tokens and requests in use, read-only, on Redis's clock (for status and
-- metrics). Window shape: what the window holds now (entries that left it count
-- no more even when no reservation has expired them yet). Bucket shape: what is
-- missing from a full bucket now (capacity - level, refill included).
--
-- KEYS[1] model log  KEYS[2] model amounts  KEYS[3] bucket levels  KEYS[4] learned shape
-- ARGV: window_s, guard_s, now_s (empty = Redis TIME), shape ('window' | 'bucket' |
-- 'learn': the one KEYS[4] holds), tokens_limit, requests_limit
-- Returns {tokens, requests}.

local window_s = tonumber(ARGV[1])
local span = window_s + tonumber(ARGV[2])
local now = clock(ARGV[3])
if is_bucket_shape(ARGV[4], KEYS[4]) then
    local tokens_limit, requests_limit = tonumber(ARGV[5]), tonumber(ARGV[6])
    local t, r = bucket_read(KEYS[3], now, tokens_limit, tokens_limit / window_s,
        requests_limit, requests_limit / window_s)
    return {math.floor(tokens_limit - t + 0.5), math.floor(requests_limit - r + 0.5)}
end
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. num(now - span), '+inf')
local tokens, requests = 0, 0
for _, member in ipairs(members) do
    tokens = tokens + (tonumber(redis.call('HGET', KEYS[2], member)) or 0)
    if string.sub(member, 1, 2) ~= 'o:' then requests = requests + 1 end
end
return {tokens, requests}
