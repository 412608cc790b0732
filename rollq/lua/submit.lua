-- Enqueue jobs, idempotently, under the queue's staleness bound.
-- KEYS[1] job stream, KEYS[2] ids hash, KEYS[3] stats hash, KEYS[4] config hash,
-- KEYS[5] version hash, KEYS[6] admission hash,
-- KEYS[7] (optional) the producer's call records (QueueKeys.submit_calls)
-- ARGV[1]: msgpack array id1, payload1, id2, payload2, ... where id is '' for producer-generated
-- ids (unique by construction: nothing to record) and the job id for caller-chosen ids
-- (recorded while queued or running; a second submission of a recorded id is skipped).
-- If the queue has a staleness bound (config max_lag and batch), at most
-- (max_lag + version + 1) * batch jobs are admitted in total (AReaL's rule): the rest are
-- refused, all or nothing for this call. On a sharded queue (rollq/shards.py) the keys are
-- one shard's: its config holds the shard's part of batch and its version hash the mirrored
-- version, so the bound holds per shard and, summed, for the queue; a call holds one shard's
-- jobs, and each call is admitted or refused as a whole.
-- ARGV[2]: the submitting producer's id, recorded as the owner of caller-chosen ids.
-- With KEYS[7], the call is numbered and a resend of it is a no-op:
-- ARGV[3]: the producer's incarnation (records of another incarnation are dropped first),
-- ARGV[4]: the call number (one sequence per producer, over every shard's record), ARGV[5]:
-- the lowest call number whose reply the producer has not read (records below it are deleted;
-- field 'lo' says where the last deletion stopped, so each record is deleted once), ARGV[6]: TTL of the records in ms (refreshed by every call).
-- ARGV[7] (optional): the number of shards the producer routes over. Shard 0's config holds
-- the queue's count (field 'shards'; no other shard's config does): a call into shard 0 from a
-- producer that counts another number does nothing and returns code 2 with the recorded count
-- (a producer connected before the queue grew learns the count and routes the jobs again).
-- ARGV[8] (optional): '1' for a check call, sent to shard 0 of a queue that grew from one
-- shard (config field 'grown') for caller-chosen ids whose shard under the new count is
-- another: ids recorded here (queued or running since before the growth) are skipped, and
-- nothing is enqueued; the producer sends the others to their shard. No id enters shard 0's
-- record from a producer that counts one shard once the count is recorded, so an id not
-- recorded here at the check is never recorded here later. A check call finding shard 0's
-- record empty removes 'grown' (no id from before the growth is left) and returns 0 as limit.
-- A call number already recorded returns its recorded reply and changes nothing else. A
-- refused call did nothing and is not recorded.
-- Returns {skipped ids, code, admission limit or -1, entry ids ('' where skipped), owners of
-- the skipped ids}; code 0: done, 1: refused by the staleness bound, 2: refused, the count
-- differs (limit: the recorded count), 3: checked (limit: 1 while 'grown' stays, else 0).
-- What the call reads or writes is checked before it writes anything: a stray value at one
-- of these keys (a SET over a hash, a counter that is not an integer) fails the whole call,
-- with an error naming the key, and the call changes nothing.
local function stray(key, what)
  return redis.error_reply('ERR rollq: key ' .. key .. ' ' .. what .. '; the call submitted nothing')
end
local function holds(key, kind)
  local t = redis.call('TYPE', key)['ok']
  return t == kind or t == 'none', t
end
for i, kind in ipairs({'stream', 'hash', 'hash', 'hash', 'hash', 'hash', 'hash'}) do
  if KEYS[i] then
    local ok, t = holds(KEYS[i], kind)
    if not ok then return stray(KEYS[i], 'holds a ' .. t .. ', not a ' .. kind) end
  end
end
local checks = {{3, 'submitted'}, {4, 'max_lag'}, {4, 'batch'}, {5, 'v'}, {6, 'admitted'}, {7, 'lo'}}
for _, c in ipairs(checks) do
  local key = KEYS[c[1]]
  local v = key and redis.call('HGET', key, c[2])
  -- an integer HINCRBY can add a call's jobs to without overflow
  if v and not (#v <= 18 and string.match(v, '^%-?%d+$')) then
    return stray(key, 'field ' .. c[2] .. ' holds ' .. string.format('%q', string.sub(v, 1, 40)) .. ', not an integer')
  end
end
local rec, fresh_rec = KEYS[7], false
if rec then
  local r = redis.call('HMGET', rec, ARGV[4], 'inc', 'lo')
  if r[2] == ARGV[3] then
    if r[1] then return cmsgpack.unpack(r[1]) end
    local lo, unread = tonumber(r[3]), tonumber(ARGV[5])
    if unread > lo then
      if unread - lo > 64 then
        -- A long gap (on a sharded queue most numbers went to other shards' records): delete
        -- by the fields held (the calls in flight here), not number by number.
        for _, f in ipairs(redis.call('HKEYS', rec)) do
          local n = tonumber(f)
          if n and n < unread then redis.call('HDEL', rec, f) end
        end
      else
        for n = lo, unread - 1 do redis.call('HDEL', rec, n) end
      end
      redis.call('HSET', rec, 'lo', unread)
    end
  else
    -- no records yet, or those of a previous incarnation under this producer id
    if r[2] then redis.call('DEL', rec) end
    fresh_rec = true
  end
end
-- Keep the reply of this call under its number (with KEYS[7]), and return it.
local function record(reply)
  if rec then
    if fresh_rec then
      redis.call('HSET', rec, ARGV[4], cmsgpack.pack(reply), 'inc', ARGV[3], 'lo', ARGV[5])
    else
      redis.call('HSET', rec, ARGV[4], cmsgpack.pack(reply))
    end
    redis.call('PEXPIRE', rec, ARGV[6])
  end
  return reply
end
local A = cmsgpack.unpack(ARGV[1])
local cfg = redis.call('HMGET', KEYS[4], 'max_lag', 'batch', 'shards')
if ARGV[7] and cfg[3] and tonumber(cfg[3]) ~= tonumber(ARGV[7]) then
  return {{}, 2, tonumber(cfg[3]), {}, {}}
end
local dup, eids, owners = {}, {}, {}
if ARGV[8] == '1' then
  for i = 1, #A, 2 do
    local owner = redis.call('HGET', KEYS[2], A[i])
    if owner then
      dup[#dup + 1] = A[i]
      owners[#owners + 1] = owner
    end
    eids[#eids + 1] = ''
  end
  local grown = 1
  if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('HDEL', KEYS[4], 'grown')
    grown = 0
  end
  return record({dup, 3, grown, eids, owners})
end
local limit = -1
if cfg[1] and cfg[2] then
  local version = tonumber(redis.call('HGET', KEYS[5], 'v') or '0')
  limit = (tonumber(cfg[1]) + version + 1) * tonumber(cfg[2])
  local admitted = tonumber(redis.call('HGET', KEYS[6], 'admitted') or '0')
  local fresh = 0
  for i = 1, #A, 2 do
    if A[i] == '' or redis.call('HEXISTS', KEYS[2], A[i]) == 0 then fresh = fresh + 1 end
  end
  if admitted + fresh > limit then return {{}, 1, limit, {}, {}} end
end
local n = 0
for i = 1, #A, 2 do
  if A[i] == '' or redis.call('HSETNX', KEYS[2], A[i], ARGV[2]) == 1 then
    eids[#eids + 1] = redis.call('XADD', KEYS[1], '*', 'd', A[i + 1])
    n = n + 1
  else
    dup[#dup + 1] = A[i]
    owners[#owners + 1] = redis.call('HGET', KEYS[2], A[i])
    eids[#eids + 1] = ''
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[3], 'submitted', n)
  if limit >= 0 then redis.call('HINCRBY', KEYS[6], 'admitted', n) end
end
return record({dup, 0, limit, eids, owners})
