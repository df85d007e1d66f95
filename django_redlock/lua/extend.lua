-- Extend a lock on one node: compare-and-pexpire.
-- KEYS[1] lock key, KEYS[2] fencing counter key
-- ARGV[1] holder token, ARGV[2] new lease in ms, ARGV[3] the holder's fence,
-- ARGV[4] counter grace in ms
-- Returns 1 when the key is ours and now has at least the new lease, 0 otherwise.
-- A lease is never shortened: a request of this holder that the node runs
-- late (its connection was dropped for a slow reply, and the node read that
-- socket after a newer one) must not cut the lease a later extend set, which
-- the holder counts on. So the key keeps the later of its expiry and
-- now + ARGV[2]; an extend to a shorter lease leaves the longer one on the
-- node, and the holder believes the shorter (the safe side).
--#include fence_writeback
local mine = ARGV[1] .. '|'
-- pcall: a key of another type (a read-write lock's hash, after an operator
-- deleted this lock and a reader took the name) is not ours: 0, so the holder
-- learns it lost the lock, where GET's WRONGTYPE error read as a node failure
-- (QuorumUnavailable, owned() still true).
local current = redis.pcall('GET', KEYS[1])
if type(current) ~= 'string' or string.sub(current, 1, #mine) ~= mine then
  return 0
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
write_back_fence(KEYS[2], ARGV[3], ARGV[4])
return 1
