-- Delete streams that hold no entries (a stopped replica's targeted stream, a closed
-- producer's result stream), so restarts with new names leave nothing behind.
-- KEYS: streams. Returns how many were deleted.
local n = 0
for _, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 1 and redis.call('XLEN', k) == 0 then
    redis.call('DEL', k)
    n = n + 1
  end
end
return n
