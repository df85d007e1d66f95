-- Delete a lock whoever holds it (operator's `locks release --force`), and wake
-- the waiters. KEYS[1] lock key; ARGV[1] the holder the operator saw (the
-- start of its token, as `locks show` and the admin print it; '' anyone):
-- the key is deleted only while that holder still holds it; ARGV[2..]
-- (optional, any number) channels to publish the key on as well, where a
-- family's waiters listen for a free member (a segment's or a permit's:
-- core.keys.free_channels). Returns the deleted value (a read-write lock's:
-- the holder's that matched, else one of its holders' values), false when
-- nothing is held, or {0, value} when another holder than ARGV[1] holds it
-- (nothing deleted: between the operator's look and the release, the lock
-- changed hands, and deleting it would let a third holder in beside the new
-- one).
-- A read-write lock's hash with ARGV[1] given: only the fields of that holder
-- go (HDEL), as rw_release.lua does for a holder that leaves; the key goes,
-- and the waiters are woken, only once no live field is left. Deleting the
-- hash for one matching reader took every other reader's hold with it, and
-- let a writer in beside readers still reading (an operator who saw a stuck
-- reader must not delete the healthy ones). Then the reply is {1, value}
-- (the holder's value) when other holders still hold the lock: nobody woken.
--#include rw_common
local expected = ARGV[1] or ''
local function seen(token)
  return expected == '' or string.sub(token, 1, #expected) == expected
end
local function wake()
  redis.call('PUBLISH', KEYS[1], 'released')
  for i = 2, #ARGV do
    redis.call('PUBLISH', ARGV[i], KEYS[1])
  end
end
local kind = redis.call('TYPE', KEYS[1]).ok
local current, matches = false, false
if kind == 'string' then
  current = redis.call('GET', KEYS[1])
  matches = seen(string.match(current, '^([^|]*)|') or current)
elseif kind == 'hash' then
  local all = redis.call('HGETALL', KEYS[1])
  local live = 0
  local now = rw_now()
  for i = 1, #all, 2 do
    local value = all[i] .. '|' .. (string.match(all[i + 1], '^%d+|(.*)$') or all[i + 1])
    if not current then
      current = value
    end
    if seen(all[i]) then
      if not matches then
        current, matches = value, true
      end
      if expected == '' then
        break  -- anyone: the whole key goes
      end
      redis.call('HDEL', KEYS[1], all[i])
    elseif rw_expiry(all[i + 1]) > now then
      live = live + 1
    end
  end
  if matches and expected ~= '' and live > 0 then
    return {1, current}  -- the other holders keep it: nobody to wake
  end
end
if current and not matches then
  return {0, current}
end
if current then
  redis.call('DEL', KEYS[1])
  wake()
end
return current
