--! include clock
--! include window
-- Rebuilding the gate's state after Redis lost it (app/domain/scheduling/gate_rebuild.py), in
-- one atomic step, then setting the marker that says the gate's state is known
-- good. Nothing is done if the marker is already set (another process rebuilt it),
-- or if the rebuild lock is no longer held with this caller's token.
--
-- Each budget restarts as spent for one window: its window log gets one entry
-- of the whole token limit (a request, so the provider's headers never take it
-- back as an observation) granted now, which counts for window_s + guard_s; and
-- its bucket levels are set to empty now, refilled over one window. Either shape
-- (or one learned, which Redis lost too) is then spent.
-- Each slot is taken again for its holder (kept if the holder took it since).
--
-- KEYS[1] the marker (string)  KEYS[2] the rebuild lock (string)
-- then three keys for each budget: log (zset), amounts (hash), bucket levels (hash)
-- then one key for each slot: the slots' set (zset)
-- ARGV: 1 the lock's token, 2 window_s, 3 guard_s, 4 the number of budgets, then two
--   for each budget: tokens limit, requests limit; then two for each slot: holder,
--   lease_s.
-- Returns 1 when rebuilt (and the marker set), 0 when left alone.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local window_s, guard_s = tonumber(ARGV[2]), tonumber(ARGV[3])
local span = window_s + guard_s
local budgets = tonumber(ARGV[4])
local now = clock()
local ttl_ms = math.ceil(span * 2000)
local member = 'rebuilt:' .. num(now)
for i = 1, budgets do
    local log, amounts, bucket = KEYS[3 * i], KEYS[3 * i + 1], KEYS[3 * i + 2]
    local tokens, requests = tonumber(ARGV[3 + 2 * i]), tonumber(ARGV[4 + 2 * i])
    redis.call('ZADD', log, now, member)
    redis.call('HSET', amounts, member, tokens)
    redis.call('HINCRBY', amounts, '_tokens', tokens)
    redis.call('HINCRBY', amounts, '_requests', 1)
    redis.call('PEXPIRE', log, ttl_ms)
    redis.call('PEXPIRE', amounts, ttl_ms)
    bucket_write(bucket, 0, 0, now, tokens, tokens / window_s, span)
end
local first_slot, first_arg = 3 + 3 * budgets, 5 + 2 * budgets
for j = 0, #KEYS - first_slot do
    local slots = KEYS[first_slot + j]
    local holder, lease_s = ARGV[first_arg + 2 * j], tonumber(ARGV[first_arg + 2 * j + 1])
    redis.call('ZADD', slots, 'NX', now + lease_s, holder)
    local ttl = redis.call('PTTL', slots)
    local want = math.ceil(lease_s * 2000)
    if ttl >= 0 and ttl < want then redis.call('PEXPIRE', slots, want) end
end
redis.call('SET', KEYS[1], num(now))
redis.call('DEL', KEYS[2])
return 1
