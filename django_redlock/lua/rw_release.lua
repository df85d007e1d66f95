-- Release a read-write lock's holder on one node, then wake who can go next.
-- KEYS and ARGV as release.lua's; returns 0 when the holder was not there, 2
-- when waiters were woken, else 1 (a read-write lock is never handed over).
-- When the last holder leaves, the first in line is woken; when that is a
-- reader, so are the readers right behind it (they share the lock), up to the
-- first writer in line. A writer that gives up its place in line (ARGV[5])
-- wakes the readers it stood in front of, unless a writer holds the lock.
--#include fence_writeback
--#include rw_common
--#include attempt
local key, token = KEYS[1], ARGV[1]
local writer_left_line = false
if ARGV[5] and ARGV[5] ~= '' then
  writer_left_line = redis.call('LREM', KEYS[3], 0, ARGV[5]) > 0
    and string.sub(token, 1, 1) == 'w'
end
-- Wake the first in line (readers: all of them up to the first writer);
-- `readers_only`: wake nobody when the first in line is a writer.
local function wake(readers_only)
  local woken = 0
  for _ = 1, 64 do
    local entry = redis.call('LINDEX', KEYS[3], 0)
    if not entry then
      break
    end
    local inbox, rest = string.match(entry, '^([^|]*)|(.*)$')
    local waiter = rest and string.match(rest, '^([^|]*)') or ''
    local reader = string.sub(waiter, 1, 1) == 'r'
    if not reader and (woken > 0 or readers_only) then
      break  -- readers woken: the writer behind them waits for them
    end
    redis.call('LPOP', KEYS[3])
    if inbox and redis.call('PUBLISH', inbox, waiter) > 0 then
      woken = woken + 1
      if not reader then
        break
      end
    end
  end
  return woken
end
local function writer_holds()
  local all = redis.call('HGETALL', key)
  local now = rw_now()
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 1) == 'w' and rw_expiry(all[i + 1]) > now then
      return true
    end
  end
  return false
end
local kind = redis.call('TYPE', key).ok
local value = false
if kind == 'hash' then
  value = redis.call('HGET', key, token)
end
if value and ARGV[7] and not cleanup_may_delete(attempt_of(value), tonumber(ARGV[7])) then
  return 0  -- a later attempt's: not this clean-up's to delete (attempt.lua)
end
if not value then
  if writer_left_line and (kind == 'none' or (kind == 'hash' and not writer_holds())) then
    wake(true)
  end
  return 0
end
redis.call('HDEL', key, token)
local now = rw_now()
if rw_expiry(value) <= now then
  return 0  -- its lease had run out: not ours any more
end
write_back_fence(KEYS[2], ARGV[2], ARGV[3])
local holders = 0
if redis.call('HLEN', key) > 0 then  -- (the last field gone, Redis dropped the key)
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    if rw_expiry(all[i + 1]) > now then
      holders = holders + 1
    end
  end
  if holders == 0 then
    redis.call('DEL', key)
  end
end
if ARGV[4] ~= '1' or holders > 0 then
  return 1
end
if wake(false) > 0 then
  return 2
end
return 1
