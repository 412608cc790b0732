-- Finish jobs atomically: result + ack + delete, at most once per stream entry.
-- KEYS[1] ids hash, KEYS[2] stats hash, KEYS[3] dead-letter stream, KEYS[4..] source streams
-- and result streams, referenced by index.
-- ARGV[1] group, ARGV[2] result TTL (ms), ARGV[3] dead-letter MAXLEN (approximate),
-- ARGV[4] msgpack array, one entry per job:
--   {source stream key index, entry id, recorded job id ('' if none), result stream key index
--    (0: nobody to tell), result payload, dead-letter payload ('' for none), counter name}
-- The XACK is the guard: it returns 1 only while the entry is pending, so a job that ran twice
-- (reclaimed from a consumer presumed dead) records one result; later finishes are refused.
-- Results for one producer are appended as ONE stream entry per call: field 'd' for a single
-- result, field 'b' (msgpack array of results) for several.
-- Returns one flag per job: 1 recorded, 0 refused.
local group, ttl, dlqmax = ARGV[1], ARGV[2], ARGV[3]
local jobs = cmsgpack.unpack(ARGV[4])
local out, batches, order, counts = {}, {}, {}, {}
for i, j in ipairs(jobs) do
  local src = KEYS[j[1]]
  if redis.call('XACK', src, group, j[2]) == 1 then
    redis.call('XDEL', src, j[2])
    if j[3] ~= '' then redis.call('HDEL', KEYS[1], j[3]) end
    local ridx = j[4]
    if ridx > 0 then
      local b = batches[ridx]
      if not b then
        b = {}
        batches[ridx] = b
        order[#order + 1] = ridx
      end
      b[#b + 1] = j[5]
    end
    if j[6] ~= '' then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', dlqmax, '*', 'd', j[6])
      counts['dead_lettered'] = (counts['dead_lettered'] or 0) + 1
    end
    counts[j[7]] = (counts[j[7]] or 0) + 1
    out[i] = 1
  else
    out[i] = 0
  end
end
for _, ridx in ipairs(order) do
  local b = batches[ridx]
  if #b == 1 then
    redis.call('XADD', KEYS[ridx], '*', 'd', b[1])
  else
    redis.call('XADD', KEYS[ridx], '*', 'b', cmsgpack.pack(b))
  end
  redis.call('PEXPIRE', KEYS[ridx], ttl)
end
for c, n in pairs(counts) do redis.call('HINCRBY', KEYS[2], c, n) end
return out
