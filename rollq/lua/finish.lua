-- Finish jobs atomically: result + ack + delete, at most once per stream entry.
-- KEYS[1] ids hash, KEYS[2] stats hash, KEYS[3] dead-letter stream, KEYS[4..] source streams
-- and result streams, referenced by index.
-- ARGV[1] group, ARGV[2] result TTL (ms), ARGV[3] dead-letter MAXLEN (approximate),
-- ARGV[4] msgpack array, one entry per job:
--   {source stream key index, entry id, recorded job id ('' if none), result stream key index
--    (0: nobody to tell), result payload, dead-letter payload ('' for none), counter name}
-- ARGV[5..] (optional) pairs {result stream key index, packed results}: the results of that
--   stream, in row order, already packed as the value of ONE result entry (the payload itself
--   when the stream gets one result, else a msgpack array of payloads). Rows for such a
--   stream carry '' as their result payload. Lua only unpacks a pack when one of its rows
--   is refused (rare), so the common case copies no payload.
-- The XACK is the guard: it returns 1 only while the entry is pending, so a job that ran twice
-- (reclaimed from a consumer presumed dead) records one result; later finishes are refused.
-- Results for one producer are appended as ONE stream entry per call: field 'd' for a single
-- result, field 'b' (msgpack array of results) for several.
-- Acknowledged entries are deleted in the same call: a few with one XDEL; more with one XTRIM
-- MINID, since every entry of a stream older than its oldest pending entry has been delivered
-- and acknowledged; only entries of this call newer than a still-pending one then need an XDEL.
-- Returns one flag per job: 1 recorded, 0 refused.
local group, ttl, dlqmax = ARGV[1], ARGV[2], ARGV[3]
local jobs = cmsgpack.unpack(ARGV[4])
local packed = {}
for i = 5, #ARGV - 1, 2 do packed[tonumber(ARGV[i])] = ARGV[i + 1] end

-- stream ids "ms-seq": true if a < b
local function idlt(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end

local out, batches, order, counts, refused = {}, {}, {}, {}, {}
local acked, sources = {}, {}
for i, j in ipairs(jobs) do
  local sidx = j[1]
  local src = KEYS[sidx]
  local ridx = j[4]
  local b
  if ridx > 0 then
    b = batches[ridx]
    if not b then
      b = {}
      batches[ridx] = b
      order[#order + 1] = ridx
    end
    b[#b + 1] = j[5]
  end
  if redis.call('XACK', src, group, j[2]) == 1 then
    local a = acked[sidx]
    if not a then
      a = {}
      acked[sidx] = a
      sources[#sources + 1] = sidx
    end
    a[#a + 1] = j[2]
    if j[3] ~= '' then redis.call('HDEL', KEYS[1], j[3]) end
    if j[6] ~= '' then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', dlqmax, '*', 'd', j[6])
      counts['dead_lettered'] = (counts['dead_lettered'] or 0) + 1
    end
    counts[j[7]] = (counts[j[7]] or 0) + 1
    out[i] = 1
  else
    out[i] = 0
    if ridx > 0 then
      b[#b] = false
      refused[ridx] = true
    end
  end
end

-- delete what was acknowledged (a few entries: one XDEL each is cheaper than the XPENDING)
for _, sidx in ipairs(sources) do
  local src, a = KEYS[sidx], acked[sidx]
  local p = #a > 4 and redis.call('XPENDING', src, group) or nil
  if p == nil then
    redis.call('XDEL', src, unpack(a))
  elseif p[1] == 0 then
    -- nothing pending: every delivered entry up to our newest one is acknowledged
    local top = a[1]
    for k = 2, #a do if idlt(top, a[k]) then top = a[k] end end
    redis.call('XTRIM', src, 'MINID', top)
    redis.call('XDEL', src, top)
  else
    local floor = p[2]
    redis.call('XTRIM', src, 'MINID', floor)
    for _, id in ipairs(a) do
      if idlt(floor, id) then redis.call('XDEL', src, id) end
    end
  end
end

-- results: one entry per result stream
for _, ridx in ipairs(order) do
  local b = batches[ridx]
  local pk = packed[ridx]
  if pk ~= nil and refused[ridx] then
    -- drop the refused ones from the pack (positions match the rows)
    local all = #b == 1 and {pk} or cmsgpack.unpack(pk)
    local keep = {}
    for k = 1, #b do
      if b[k] ~= false then keep[#keep + 1] = all[k] end
    end
    pk = nil
    b = keep
  elseif pk == nil and refused[ridx] then
    local keep = {}
    for k = 1, #b do
      if b[k] ~= false then keep[#keep + 1] = b[k] end
    end
    b = keep
  end
  if pk ~= nil then
    redis.call('XADD', KEYS[ridx], '*', #b == 1 and 'd' or 'b', pk)
    redis.call('PEXPIRE', KEYS[ridx], ttl)
  elseif #b > 0 then
    if #b == 1 then
      redis.call('XADD', KEYS[ridx], '*', 'd', b[1])
    else
      redis.call('XADD', KEYS[ridx], '*', 'b', cmsgpack.pack(b))
    end
    redis.call('PEXPIRE', KEYS[ridx], ttl)
  end
end
for c, n in pairs(counts) do redis.call('HINCRBY', KEYS[2], c, n) end
return out
