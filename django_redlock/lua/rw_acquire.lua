-- Acquire a read-write lock on one node (a reader or the writer, by the token's
-- first character: see rw_common.lua). KEYS and ARGV as acquire.lua's; the
-- replies too, with one more reason for a fourth element: 4 when the key is a
-- plain lock's (a name used as two kinds of lock; 1: another type).
-- Readers share the lock; the writer holds it alone. A reader also queues
-- behind a writer that stands in line before it (no writer starvation),
-- unless it was just woken by name (ARGV[6] '2': a release let it go first).
--#include fence_issue
--#include waiter_queue
--#include rw_common
--#include attempt
local key, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
local queue = ARGV[6]
local now = rw_now()
local kind = redis.call('TYPE', key).ok
if kind ~= 'none' and kind ~= 'hash' then
  local code = 1
  if kind == 'string' then code = 4 end
  return {0, redis.call('PTTL', key), now, code}
end
local writer = string.sub(token, 1, 1) == 'w'
local mine, busy_until, holders_until = nil, 0, 0
if kind == 'hash' then  -- (no key: nobody holds it, nothing to read)
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local field, value = all[i], all[i + 1]
    local expiry = rw_expiry(value)
    if expiry <= now then
      redis.call('HDEL', key, field)
    elseif field == token then
      mine = value
    else
      if expiry > holders_until then holders_until = expiry end
      if writer or string.sub(field, 1, 1) == 'w' then
        if expiry > busy_until then busy_until = expiry end
      end
    end
  end
end
-- The key's expiry covers its latest field: the other holders' (read above,
-- the expired ones dropped) or this one's, now + lease (rw_cover without
-- reading the hash again).
local function cover()
  redis.call('PEXPIRE', key, string.format('%.0f', math.max(holders_until, now + lease) - now))
end
if mine then
  -- Ours already: an earlier attempt of this acquire whose reply was lost.
  -- This attempt takes it over (its number in the owner: only its own
  -- clean-up may delete it), unless this request is itself a late one of an
  -- earlier attempt (attempt.lua).
  local rest = string.match(mine, '^%d+|(.*)$')
  local fence = string.match(rest, '^([^|]*)|')
  local this = attempt_of(ARGV[3])
  if this > 0 then
    if attempt_of(mine) > this then
      return {1, fence}  -- late: a later attempt has it (its reply is nobody's)
    end
    rest = fence .. '|' .. ARGV[3]
  end
  redis.call('HSET', key, token, string.format('%.0f', now + lease) .. '|' .. rest)
  cover()
  return {1, fence}
end
if not writer and busy_until == 0 and queue ~= '2' then
  -- A writer in line before this reader goes first: the reader queues
  -- behind it, although the readers holding the lock now would let it in.
  for _, entry in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
    if entry == ARGV[8] then
      break
    end
    local waiter = string.match(entry, '^[^|]*|([^|]*)')
    if waiter and string.sub(waiter, 1, 1) == 'w' then
      busy_until = math.max(holders_until, now + 50)
      break
    end
  end
end
if busy_until > 0 then
  local pttl = busy_until - now
  if queue ~= '0' then
    join_queue(KEYS[3], ARGV[8], queue, ARGV[7], pttl)
    return {0, pttl, now}
  end
  return {0, pttl}
end
if queue ~= '0' then
  redis.call('LREM', KEYS[3], 0, ARGV[8])
end
local fence = '0'
if ARGV[4] == '1' then
  fence = issue_fence(KEYS[2], ARGV[5])
end
redis.call('HSET', key, token, string.format('%.0f', now + lease) .. '|' .. fence .. '|' .. ARGV[3])
cover()
return {1, fence}
