-- Mirror a committed policy version into one shard (>= 1) of a sharded queue: field 'v' of
-- the shard's version hash, which its SUBMIT calls read for the staleness bound. Never lowers
-- it (two publishers may mirror out of order).
-- KEYS[1] the shard's version hash; ARGV[1] version (integer)
-- Returns 1 if written, 0 if the shard already holds an equal or newer version.
local cur = redis.call('HGET', KEYS[1], 'v')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1])
return 1
