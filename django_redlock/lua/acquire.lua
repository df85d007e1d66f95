-- Acquire a lock on one node, in one round trip.
-- KEYS[1] lock key, KEYS[2] fencing counter key, KEYS[3] waiter queue key
-- ARGV[1] holder token, ARGV[2] lease in ms, ARGV[3] owner JSON,
-- ARGV[4] '1' to issue a fencing token, ARGV[5] counter grace in ms,
-- ARGV[6] the waiter queue: '0' leave it alone (a first attempt), '1' join at
-- the back when busy, '2' join at the front (a waiter that was just woken and
-- lost the race keeps its place); ARGV[7] how long the queue outlives the lock
-- (ms); ARGV[8] the waiter's queue entry, '<inbox channel>|<token>', or
-- '<inbox channel>|<token>|<lease ms>|<fenced 0/1>|<owner>' for a waiter the
-- release may hand the lock to outright (see release.lua)
-- Returns {1, fence} when this holder now has the key; {0, pttl} when it is
-- busy, {0, pttl, now} when busy for a waiter (this node's clock in ms: a lock
-- handed over later is timed from it, see rounds.handed_over); a fourth
-- element when the key holds something no lock wrote: 1 a value of another
-- type (a list, a set...), 2 a string not in the lock's format; or 3 when it
-- is a read-write lock's (a hash: one name used as two kinds of lock). Such a key is
-- busy like any other, and the waiter can say what is in the way.
--#include fence_issue
--#include waiter_queue
local mine = ARGV[1] .. '|'
local queue = ARGV[6]
-- pcall: GET on a key of another type is an error, which would hide the
-- answer "busy" behind a script error (the node answered; it is not down).
local current = redis.pcall('GET', KEYS[1])
local foreign = 0
if type(current) == 'table' then
  foreign = 1
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    foreign = 3  -- a read-write lock's (rw_acquire.lua): one name, two kinds of lock
  end
elseif current and not string.find(current, '^[^|]+|%d+|') then
  foreign = 2
end
if current then
  if foreign == 0 and string.sub(current, 1, #mine) == mine then
    -- Ours already: an earlier attempt of this same acquire whose reply was
    -- lost, or a release handed the lock to this waiter (release.lua) before
    -- the waiter read that release's notice.
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, string.match(current, '^[^|]*|([^|]*)|')}
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if queue ~= '0' then
    join_queue(KEYS[3], ARGV[8], queue, ARGV[7], pttl)
    if foreign ~= 0 then
      return {0, pttl, server_ms(), foreign}
    end
    return {0, pttl, server_ms()}
  end
  if foreign ~= 0 then
    return {0, pttl, 0, foreign}
  end
  return {0, pttl}
end
if queue ~= '0' then
  redis.call('LREM', KEYS[3], 0, ARGV[8])  -- served: out of the line
end
local fence = '0'
if ARGV[4] == '1' then
  fence = issue_fence(KEYS[2], ARGV[5])
end
redis.call('SET', KEYS[1], mine .. fence .. '|' .. ARGV[3], 'NX', 'PX', ARGV[2])
return {1, fence}
