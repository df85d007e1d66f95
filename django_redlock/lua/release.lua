-- Release a lock on one node: compare-and-delete, then wake the waiters.
-- KEYS[1] lock key, KEYS[2] fencing counter key
-- ARGV[1] holder token, ARGV[2] the holder's fence ('0' when unfenced),
-- ARGV[3] counter grace in ms, ARGV[4] '1' to wake the waiters ('0' for the
-- clean-up after a lost attempt: waking every waiter for a lock that was never
-- held only makes them all race again)
-- Returns 0 when the key was not ours (never touches others' keys), else 1 + the
-- number of subscribers the release notice reached.
--#include fence_writeback
local mine = ARGV[1] .. '|'
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #mine) ~= mine then
  return 0
end
redis.call('DEL', KEYS[1])
write_back_fence(KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] == '1' then
  -- 1 + how many subscribers heard it: the releaser learns whether anyone waits.
  return 1 + redis.call('PUBLISH', KEYS[1], 'released')
end
return 1
