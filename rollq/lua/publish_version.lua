-- Record a committed policy version, only if it is newer than the current one, then log and
-- announce it. The record is durable; the announcement is only a hint.
-- KEYS[1] version record, KEYS[2] versions log stream,
-- KEYS[3] (optional) the queue's config hash (shard 0's), to read its shard count
-- ARGV[1] version (integer), ARGV[2] record (msgpack), ARGV[3] control channel,
-- ARGV[4] log MAXLEN (approximate)
-- Returns 0 if an equal or newer version is already recorded; else 1, or with KEYS[3] the
-- queue's number of shards (field 'shards', 1 if none), for the publisher to mirror the
-- version into shards 1.. (rollq/lua/mirror_version.lua) without another round trip.
local cur = redis.call('HGET', KEYS[1], 'v')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'd', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'v', ARGV[1], 'd', ARGV[2])
redis.call('PUBLISH', ARGV[3], 'version ' .. ARGV[1])
if KEYS[3] then return tonumber(redis.call('HGET', KEYS[3], 'shards') or '1') or 1 end
return 1
