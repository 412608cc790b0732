-- Set (or remove) one shard's part of the queue's staleness bound, from a client that counts
-- ARGV[1] shards. Shard 0's config holds the queue's count (field 'shards'): a client that
-- counts another number writes nothing and learns the recorded count (a producer connected
-- before the queue grew), so no shard is left with a part of another split.
-- KEYS[1] the shard's config hash; ARGV[1] the client's shard count, ARGV[2] max_lag ('' to
-- remove the bound), ARGV[3] the shard's part of batch
-- Returns 0 if written, else the recorded count.
local have = redis.call('HGET', KEYS[1], 'shards')
if have and tonumber(have) ~= tonumber(ARGV[1]) then return tonumber(have) end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], 'max_lag', 'batch')
else
  redis.call('HSET', KEYS[1], 'max_lag', ARGV[2], 'batch', ARGV[3])
end
return 0
