-- Mark a queued or running job cancelled; consumers see the mark (and a pub/sub hint).
-- KEYS[1] ids hash; ARGV[1] job id, ARGV[2] control channel
-- Returns 1 if the job was known (queued or running), 0 otherwise.
local s = redis.call('HGET', KEYS[1], ARGV[1])
if not s then return 0 end
if s ~= 'c' then
  redis.call('HSET', KEYS[1], ARGV[1], 'c')
  redis.call('PUBLISH', ARGV[2], 'cancel ' .. ARGV[1])
end
return 1
