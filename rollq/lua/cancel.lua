-- Cancel a job. Still queued: delete its entry (it never runs). Delivered: leave a short-lived
-- mark that the running replica checks every heartbeat, plus a pub/sub hint.
-- KEYS[1] the job's stream, KEYS[2] its cancel mark, KEYS[3] ids hash, KEYS[4] stats hash
-- ARGV[1] entry id, ARGV[2] job id, ARGV[3] control channel, ARGV[4] mark TTL (s),
-- ARGV[5] group, ARGV[6] '1' if the id is recorded in the ids hash
-- Returns 1 if removed from the queue, 2 if marked (running or finishing).
local p = redis.pcall('XPENDING', KEYS[1], ARGV[5], ARGV[1], ARGV[1], 1)
local delivered = type(p) == 'table' and not p.err and #p > 0
if not delivered and redis.call('XDEL', KEYS[1], ARGV[1]) == 1 then
  if ARGV[6] == '1' then redis.call('HDEL', KEYS[3], ARGV[2]) end
  redis.call('HINCRBY', KEYS[4], 'cancelled', 1)
  return 1
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[4])
redis.call('PUBLISH', ARGV[3], 'cancel ' .. ARGV[2])
return 2
