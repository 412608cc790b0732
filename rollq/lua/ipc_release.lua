-- The publisher of a leased IPC version starts releasing it: no replica can claim it (or an
-- older one) from now on; returns the hash as it stands, whose claims it waits for.
-- KEYS[1] the queue's weights_ipc_claims hash; ARGV[1] the version
-- Returns HGETALL of the hash: 'released', the version, then 'c:<replica>', "<version> <deadline ms>", ...
local released = tonumber(redis.call('HGET', KEYS[1], 'released') or '0') or 0
if tonumber(ARGV[1]) > released then redis.call('HSET', KEYS[1], 'released', ARGV[1]) end
return redis.call('HGETALL', KEYS[1])
