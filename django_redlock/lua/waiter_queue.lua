-- Shared by acquire.lua and rw_acquire.lua: a busy attempt's waiter takes its
-- place in the line once (a waiter retrying on its timer is already queued):
-- at the back, or at the front for a waiter that was just woken and lost the
-- race (`queue` '2'). The line outlives the lock by `keep_ms` (ARGV[7]) past
-- the holder's `pttl`.
local function join_queue(queue_key, entry, queue, keep_ms, pttl)
  if not redis.call('LPOS', queue_key, entry) then
    if queue == '2' then
      redis.call('LPUSH', queue_key, entry)
    else
      redis.call('RPUSH', queue_key, entry)
    end
  end
  local keep = tonumber(keep_ms)
  if pttl > 0 then keep = keep + pttl end
  redis.call('PEXPIRE', queue_key, keep)
end
