-- Give the schedule lock back, only if it is still ours.
-- KEYS[1] lock  ARGV: token
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
