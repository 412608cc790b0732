-- Take over the pending jobs of a consumer whose lease (heartbeat key) has expired.
-- KEYS[1] job stream, KEYS[2] the dead consumer's heartbeat key, KEYS[3] consumer registry,
-- KEYS[4] the dead consumer's targeted stream (deleted with it once empty)
-- ARGV[1] group, ARGV[2] dead consumer, ARGV[3] new owner, ARGV[4] max entries to take,
-- ARGV[5] '1' to forget the dead consumer once it holds nothing more
-- Returns {entries as XCLAIM returns them, the ids asked for, their delivery counts}.
if redis.call('EXISTS', KEYS[2]) == 1 then return {{}, {}, {}} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {{}, {}, {}} end
local pend = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', ARGV[4], ARGV[2])
if type(pend) == 'table' and pend.err then return {{}, {}, {}} end  -- no group on that stream
if #pend == 0 then
  if ARGV[5] == '1' then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    redis.call('HDEL', KEYS[3], ARGV[2])
    if redis.call('EXISTS', KEYS[4]) == 1 and redis.call('XLEN', KEYS[4]) == 0 then
      redis.call('DEL', KEYS[4])
    end
  end
  return {{}, {}, {}}
end
local ids, counts = {}, {}
for i, p in ipairs(pend) do
  ids[i] = p[1]
  counts[i] = p[4] + 1
end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids))
return {claimed, ids, counts}
