-- Enqueue jobs idempotently.
-- KEYS[1] job stream, KEYS[2] ids hash, KEYS[3] stats hash
-- ARGV: jid1, payload1, jid2, payload2, ...
-- A job id already queued or running is skipped; returns the skipped ids.
local dup = {}
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], 'q') == 1 then
    redis.call('XADD', KEYS[1], '*', 'd', ARGV[i + 1])
    n = n + 1
  else
    dup[#dup + 1] = ARGV[i]
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], 'submitted', n) end
return dup
