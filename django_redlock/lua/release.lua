-- Release a lock on one node: compare-and-delete, then wake the next waiter,
-- or hand the lock to it.
-- KEYS[1] lock key, KEYS[2] fencing counter key, KEYS[3] waiter queue key
-- ARGV[1] holder token, ARGV[2] the holder's fence ('0' when unfenced),
-- ARGV[3] counter grace in ms, ARGV[4] '1' to wake a waiter ('0' for the
-- clean-up after a lost attempt: the lock was never held, nobody waits for it),
-- ARGV[5] (optional) a waiter's queue entry to take out of the line first: a
-- waiter that gives up, and may have been handed the lock meanwhile ('' none),
-- ARGV[6] (optional) a channel to publish the key on once it is deleted: a
-- semaphore's free channel, where the first in its line listens for a permit
-- ARGV[7] (optional) for the clean-up after a lost attempt: that attempt's
-- number k, or -k for a hand-over it took over; the key is deleted only when
-- that attempt (or an earlier one) wrote it (attempt.lua's cleanup_may_delete)
-- Returns 0 when the key was not ours (never touches others' keys), 2 when a
-- waiter was woken, 3 when the lock was handed to a waiter, else 1.
--#include fence_writeback
--#include fence_issue
--#include attempt
if ARGV[5] and ARGV[5] ~= '' then
  redis.call('LREM', KEYS[3], 0, ARGV[5])
end
local mine = ARGV[1] .. '|'
-- pcall: a key of another type is not ours (0: the holder lost the lock), not
-- a script error (see extend.lua).
local current = redis.pcall('GET', KEYS[1])
if type(current) ~= 'string' or string.sub(current, 1, #mine) ~= mine then
  return 0
end
if ARGV[7] and not cleanup_may_delete(attempt_of(current), tonumber(ARGV[7])) then
  return 0  -- a later attempt's (or a hand-over's): not this clean-up's to delete
end
redis.call('DEL', KEYS[1])
write_back_fence(KEYS[2], ARGV[2], ARGV[3])
if ARGV[6] and ARGV[6] ~= '' then
  redis.call('PUBLISH', ARGV[6], KEYS[1])  -- which permit is free: tried first
end
if ARGV[4] == '1' then
  -- The first in line: its entry is '<inbox>|<token>', and the notice goes to
  -- that waiter's own process only. Waking every waiter made each release cost
  -- one failed attempt per waiter (a thundering herd).
  -- An entry '<inbox>|<token>|<lease ms>|<fenced>|<first ms>|<owner>' (a
  -- waiter queued on the hand-over node, rounds.hand_over_node) is handed the lock here: the key is set for it, and the
  -- notice carries its fence and this node's clock, so the waiter holds the
  -- lock when it wakes, without a round trip of its own.
  -- An entry whose inbox nobody listens to any more (its process is gone) is
  -- skipped (and a lock handed to it taken back), so a dead waiter does not
  -- stall the line until the others' timers.
  -- The entry's <first ms> (after <fenced>): on a manager of several nodes, how
  -- long the waiter has the lock to itself here while it asks the other nodes,
  -- written into the owner as '"first_until":<this node's ms>' (acquire.lua
  -- refuses everyone else's round while it lasts); 0 on one node.
  for _ = 1, 8 do
    local entry = redis.call('LPOP', KEYS[3])
    if not entry then
      break
    end
    local inbox, rest = string.match(entry, '^([^|]*)|(.*)$')
    if inbox then
      local token, lease, fenced, first, owner =
        string.match(rest, '^([^|]*)|(%d+)|([01])|(%d+)|(.*)$')
      if token and tonumber(lease) > 0 then  -- (a lease of 0 would fail the SET)
        local fence, now = '0', nil
        if fenced == '1' then
          fence, now = issue_fence(KEYS[2], ARGV[3])
        else
          now = server_ms()
        end
        if tonumber(first) > 0 and string.sub(owner, -1) == '}' then
          owner = string.sub(owner, 1, -2) .. ',"first_until":'
            .. string.format('%.0f', now + tonumber(first)) .. '}'
        end
        redis.call('SET', KEYS[1], token .. '|' .. fence .. '|' .. owner, 'PX', lease)
        -- The key rides along: a process whose waiter is gone (it won on the
        -- other nodes, or gave up, before this release came) hands it on.
        if redis.call('PUBLISH', inbox, token .. '|' .. fence .. '|' .. string.format('%.0f', now)
                      .. '|' .. KEYS[1]) > 0 then
          return 3
        end
        redis.call('DEL', KEYS[1])
      elseif redis.call('PUBLISH', inbox, rest) > 0 then
        return 2
      end
    end
  end
end
return 1
