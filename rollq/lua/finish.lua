-- Finish jobs atomically: result + ack + delete, at most once per stream entry.
-- KEYS[1] ids hash, KEYS[2] stats hash, KEYS[3] dead-letter stream, KEYS[4..] source streams
-- and result streams, referenced by index from ARGV.
-- ARGV[1] group, ARGV[2] result TTL (ms), ARGV[3] dead-letter MAXLEN (approximate)
-- then 7 values per job:
--   source stream key index, entry id, job id ('' if unknown), result stream key index (0: none),
--   result payload, dead-letter payload ('' for none), counter to increment.
-- The XACK is the guard: it returns 1 only while the entry is pending, so a job that ran twice
-- (reclaimed from a consumer presumed dead) records one result; later finishes are refused.
-- Returns one flag per job: 1 recorded, 0 refused.
local group, ttl, dlqmax = ARGV[1], ARGV[2], ARGV[3]
local out = {}
local touched = {}
local counts = {}
for i = 4, #ARGV, 7 do
  local src = KEYS[tonumber(ARGV[i])]
  local eid, jid, ridx = ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  if redis.call('XACK', src, group, eid) == 1 then
    redis.call('XDEL', src, eid)
    if jid ~= '' then redis.call('HDEL', KEYS[1], jid) end
    if ridx > 0 then
      local rk = KEYS[ridx]
      redis.call('XADD', rk, '*', 'd', ARGV[i + 4])
      touched[rk] = true
    end
    if ARGV[i + 5] ~= '' then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', dlqmax, '*', 'd', ARGV[i + 5])
      counts['dead_lettered'] = (counts['dead_lettered'] or 0) + 1
    end
    local c = ARGV[i + 6]
    counts[c] = (counts[c] or 0) + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
for k, _ in pairs(touched) do redis.call('PEXPIRE', k, ttl) end
for c, n in pairs(counts) do redis.call('HINCRBY', KEYS[2], c, n) end
return out
