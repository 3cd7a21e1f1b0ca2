-- The schedule lock: the one Celery beat allowed to send ticks holds it.
-- KEYS[1] lock  ARGV: token, lease_ms
-- Takes the lock when free, renews it when ours; returns 1 if we hold it, else 0.
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
    return 1
end
return 0
