-- A replica claims a leased IPC version before copying the trainer's tensors straight into its
-- live weights: refused once the publisher started releasing that version (or a newer one),
-- so a release either sees the claim and waits for it, or the replica sees the release.
-- KEYS[1] the queue's weights_ipc_claims hash; ARGV[1] the replica, ARGV[2] the version,
-- ARGV[3] the claim's deadline (unix ms, the host's clock: trainer and replica share the host)
-- Returns 1 if claimed, 0 if the version is being released.
local released = tonumber(redis.call('HGET', KEYS[1], 'released') or '0') or 0
if released >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'c:' .. ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
return 1
