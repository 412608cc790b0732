-- The publisher of a leased IPC version starts releasing it: no replica can claim it (or an
-- older one) from now on; returns the claims held now, which it waits for.
-- KEYS[1] the queue's weights_ipc_claims hash; ARGV[1] the version
-- Returns a flat list: replica, "<version> <deadline ms>", ...
local released = tonumber(redis.call('HGET', KEYS[1], 'released') or '0') or 0
if tonumber(ARGV[1]) > released then redis.call('HSET', KEYS[1], 'released', ARGV[1]) end
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 2) == 'c:' then
    out[#out + 1] = string.sub(all[i], 3)
    out[#out + 1] = all[i + 1]
  end
end
return out
