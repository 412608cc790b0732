-- Record a queue's number of shards, once, in shard 0's config (field 'shards').
-- KEYS[1] shard 0's config hash, KEYS[2] shard 0's ids hash; ARGV[1] the count (integer)
-- A count > 1 recorded while shard 0 holds caller-chosen ids (queued or running: the queue
-- ran with one shard) also sets field 'grown': those ids keep their record in shard 0, which
-- producers check before they enqueue such an id in its shard under the new count
-- (rollq/lua/submit.lua's check calls). In one script with the record, so no id enters
-- shard 0 between the two (submit.lua refuses a producer that counts one shard from then on).
-- Returns {1, count} if recorded now, {0, recorded count} if one was already.
local have = redis.call('HGET', KEYS[1], 'shards')
if have then return {0, have} end
redis.call('HSET', KEYS[1], 'shards', ARGV[1])
if tonumber(ARGV[1]) > 1 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[1], 'grown', 1)
end
return {1, ARGV[1]}
