-- Acquire a read-write lock on one node (a reader or the writer, by the token's
-- first character: see rw_common.lua). KEYS and ARGV as acquire.lua's; the
-- replies too, with one more reason for a fourth element: 4 when the key is a
-- plain lock's (a name used as two kinds of lock); 1 another type, or a hash
-- not in the read-write lock's format (rw_format.lua); 2 a string not in the
-- plain lock's format. Such a key is busy, and nothing of it is touched.
-- Readers share the lock; the writer holds it alone. A reader also queues
-- behind a writer that stands in line before it (no writer starvation),
-- unless it was just woken by name (ARGV[6] '2': a release let it go first).
-- ARGV[9] '1': this node can tell whether a queued writer's process still
-- listens on its inbox (PUBSUB NUMSUB; '0' on a Cluster or Sentinel node).
--#include fence_issue
--#include waiter_queue
--#include rw_common
--#include attempt
local key, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
local queue = ARGV[6]
local now = rw_now()
local kind = redis.call('TYPE', key).ok
local all = nil
if kind == 'hash' then  -- (no key: nobody holds it, nothing to read)
  all = redis.call('HGETALL', key)
  if not rw_hash_is_lock(all) then
    kind = 'foreign'
  end
end
if kind ~= 'none' and kind ~= 'hash' then
  local code = 1
  if kind == 'string' then
    code = 2
    if string.find(redis.call('GET', key), '^[^|]+|%d+|') then
      code = 4  -- a plain lock's value (acquire.lua's format)
    end
  end
  return {0, redis.call('PTTL', key), now, code}
end
local writer = string.sub(token, 1, 1) == 'w'
local mine, busy_until, holders_until = nil, 0, 0
if all then
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
-- A writer in line before this reader goes first: the reader queues behind
-- it, although the readers holding the lock now would let it in. But a writer
-- whose process died in line (killed while queued: no release ever takes its
-- entry out) must not hold the readers back for good:
--   t0  reader R1 holds; writer W queues; R1 and W are killed
--   t1  R1's lease runs out: the lock is free, W's entry is still first
--   t2  every reader yields to W, and each retry kept the line alive: no
--       reader got a free lock until some writer came (seen for 45 s)
-- Where the node can tell (ARGV[9] '1'), an entry whose inbox nobody listens
-- to is dropped (release.lua skips such entries too). Everywhere, a reader
-- behind a writer never prolongs the line: only the writer's own attempts
-- (and the holders' leases) do, so a dead writer's entry expires with it.
local behind_writer = false
if not writer and busy_until == 0 and queue ~= '2' then
  for _, entry in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
    if entry == ARGV[8] then
      break
    end
    local inbox, waiter = string.match(entry, '^([^|]*)|([^|]*)')
    if waiter and string.sub(waiter, 1, 1) == 'w' then
      if ARGV[9] == '1' and redis.call('PUBSUB', 'NUMSUB', inbox)[2] == 0 then
        redis.call('LREM', KEYS[3], 0, entry)
      else
        busy_until = math.max(holders_until, now + 50)
        behind_writer = true
        break
      end
    end
  end
end
if busy_until > 0 then
  local pttl = busy_until - now
  if queue ~= '0' then
    if behind_writer then
      if not redis.call('LPOS', KEYS[3], ARGV[8]) then
        redis.call('RPUSH', KEYS[3], ARGV[8])  -- into the writer's line, keeping its expiry
      end
    else
      join_queue(KEYS[3], ARGV[8], queue, ARGV[7], pttl)
    end
    return {0, pttl, now}
  end
  return {0, pttl}
end
if queue ~= '0' then
  redis.call('LREM', KEYS[3], 0, ARGV[8])
end
local fence, clock = '0', nil
if ARGV[4] == '1' then
  fence, clock = issue_fence(KEYS[2], ARGV[5])
end
redis.call('HSET', key, token, string.format('%.0f', now + lease) .. '|' .. fence .. '|' .. ARGV[3])
cover()
return granted(fence, clock, lease)
