-- Release a read-write lock's holder on one node, then wake who can go next.
-- KEYS and ARGV as release.lua's; returns 0 when the holder was not there, 2
-- when waiters were woken, else 1 (a read-write lock is never handed over).
-- When the last holder leaves, the first in line is woken; when that is a
-- reader, so are the readers right behind it (they share the lock), up to the
-- first writer in line.
--#include fence_writeback
--#include rw_common
if ARGV[5] then
  redis.call('LREM', KEYS[3], 0, ARGV[5])
end
local key, token = KEYS[1], ARGV[1]
if redis.call('TYPE', key).ok ~= 'hash' then
  return 0
end
local value = redis.call('HGET', key, token)
if not value then
  return 0
end
redis.call('HDEL', key, token)
local now = rw_now()
if rw_expiry(value) <= now then
  return 0  -- its lease had run out: not ours any more
end
write_back_fence(KEYS[2], ARGV[2], ARGV[3])
local holders = 0
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  if rw_expiry(all[i + 1]) > now then
    holders = holders + 1
  end
end
if holders == 0 then
  redis.call('DEL', key)
end
if ARGV[4] ~= '1' or holders > 0 then
  return 1
end
local woken = 0
for _ = 1, 64 do
  local entry = redis.call('LINDEX', KEYS[3], 0)
  if not entry then
    break
  end
  local inbox, rest = string.match(entry, '^([^|]*)|(.*)$')
  local waiter = rest and string.match(rest, '^([^|]*)') or ''
  local reader = string.sub(waiter, 1, 1) == 'r'
  if woken > 0 and not reader then
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
if woken > 0 then
  return 2
end
return 1
