-- Settle one reservation after its call's ledger row is written, or move a
-- synchronous call's reservation to its item's id (batchgen.limits.money_budgets).
--
-- KEYS[1]: the reservation's index (money_reserve.lua): the hashes it is held in.
-- ARGV[1] = 'settle': ARGV[2] id, ARGV[3] actual_micros. In each hash that still holds
--   'r:<id>', the reservation is released and the actual price added to 'used'; the
--   index is deleted, so a second settle of the same id is a no-op (and so is one
--   whose reservation a rebuild released first: its price is then in 'used').
--   Returns the number of hashes settled.
-- ARGV[1] = 'adopt': ARGV[2] old id, ARGV[3] new id; KEYS[2] the new id's index. Each
--   hash's 'r:<old>' becomes 'r:<new>' (dropped if 'r:<new>' is held already: a rebuild
--   added it as in flight). Returns the number of hashes moved or dropped.
local index = KEYS[1]
local listed = redis.call('GET', index)
if not listed then return 0 end
local mode = ARGV[1]
local id = 'r:' .. ARGV[2]
local count = 0
for key in string.gmatch(listed, '%S+') do
    local entry = redis.call('HGET', key, id)
    if entry then
        count = count + 1
        redis.call('HDEL', key, id)
        local amount = tonumber(string.match(entry, '^(%S+)')) or 0
        local new_id = mode == 'adopt' and ('r:' .. ARGV[3]) or nil
        if new_id and redis.call('HEXISTS', key, new_id) == 0 then
            redis.call('HSET', key, new_id, entry)
        else
            local reserved = redis.call('HINCRBY', key, 'reserved', -amount)
            if reserved < 0 then redis.call('HSET', key, 'reserved', 0) end
            if mode == 'settle' then
                redis.call('HINCRBY', key, 'used', math.max(0, tonumber(ARGV[3]) or 0))
            end
        end
    end
end
if mode == 'adopt' then
    local ttl = redis.call('PTTL', index)
    redis.call('SET', KEYS[2], listed, 'PX', ttl > 0 and ttl or 86400000)
end
redis.call('DEL', index)
return count
