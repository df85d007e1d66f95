-- Release a lock on one node: compare-and-delete, then wake the next waiter.
-- KEYS[1] lock key, KEYS[2] fencing counter key, KEYS[3] waiter queue key
-- ARGV[1] holder token, ARGV[2] the holder's fence ('0' when unfenced),
-- ARGV[3] counter grace in ms, ARGV[4] '1' to wake a waiter ('0' for the
-- clean-up after a lost attempt: the lock was never held, nobody waits for it)
-- Returns 0 when the key was not ours (never touches others' keys), 2 when a
-- waiter was woken, else 1.
--#include fence_writeback
local mine = ARGV[1] .. '|'
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #mine) ~= mine then
  return 0
end
redis.call('DEL', KEYS[1])
write_back_fence(KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] == '1' then
  -- Wake one waiter, the first in line: its entry is '<inbox>|<token>', and the
  -- notice goes to that waiter's own listener only. Waking every waiter made
  -- each release cost one failed attempt per waiter (a thundering herd).
  -- An entry whose inbox nobody listens to any more (its process is gone) is
  -- skipped, so a dead waiter does not stall the line until the others' timers.
  for _ = 1, 8 do
    local entry = redis.call('LPOP', KEYS[3])
    if not entry then
      break
    end
    local bar = string.find(entry, '|', 1, true)
    if bar and redis.call('PUBLISH', string.sub(entry, 1, bar - 1),
                          string.sub(entry, bar + 1)) > 0 then
      return 2
    end
  end
end
return 1
