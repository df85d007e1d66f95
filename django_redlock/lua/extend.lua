-- Extend a lock on one node: compare-and-pexpire.
-- KEYS[1] lock key, KEYS[2] fencing counter key
-- ARGV[1] holder token, ARGV[2] new lease in ms, ARGV[3] the holder's fence,
-- ARGV[4] counter grace in ms
-- Returns 1 when the key is ours and now has the new lease, 0 otherwise.
--#include fence_writeback
local mine = ARGV[1] .. '|'
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #mine) ~= mine then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
write_back_fence(KEYS[2], ARGV[3], ARGV[4])
return 1
