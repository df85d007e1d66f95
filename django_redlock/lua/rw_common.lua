-- Shared by the read-write lock's scripts (rw_acquire, rw_release, rw_extend)
-- and extend_many. A read-write lock's key is a hash: one field per holder,
-- named by its token, whose first character says its mode ('r.<token>' a
-- reader, 'w.<token>' the writer), valued '<expiry ms>|<fence>|<owner>' (this
-- node's clock). Expired fields are dropped by
-- whichever script looks at them next; the key's own expiry covers the latest.
-- A hash in another format is none of theirs (rw_format.lua).
--#include rw_format
local function rw_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function rw_expiry(value)
  return tonumber(string.match(value, '^(%d+)')) or 0
end
-- Set the key's expiry to cover its latest field (at least `floor` ms from now).
local function rw_cover(key, now, floor)
  local latest = now + floor
  local all = redis.call('HGETALL', key)
  for i = 2, #all, 2 do
    local e = rw_expiry(all[i])
    if e > latest then latest = e end
  end
  if #all > 0 then
    redis.call('PEXPIRE', key, string.format('%.0f', latest - now))
  end
end
-- Extend holder `token` to `lease` ms on `key` (never shorter than it had): 1
-- when it held the lock, else 0.
local function rw_extend(key, token, lease)
  if redis.call('TYPE', key).ok ~= 'hash' then
    return 0
  end
  local value = redis.call('HGET', key, token)
  if not value then
    return 0
  end
  local now = rw_now()
  if rw_expiry(value) <= now then
    redis.call('HDEL', key, token)
    return 0
  end
  -- Never shortened (see extend.lua): the later of its expiry and now + lease.
  local expiry = math.max(rw_expiry(value), now + tonumber(lease))
  local rest = string.match(value, '^%d+|(.*)$')
  redis.call('HSET', key, token, string.format('%.0f', expiry) .. '|' .. rest)
  rw_cover(key, now, expiry - now)
  return 1
end
