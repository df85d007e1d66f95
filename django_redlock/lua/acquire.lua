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
-- ARGV[3]'s owner ends with the attempt's number ('"n":<k>', see attempt.lua).
-- Returns {1, fence} when this holder now has the key ({1, fence, 1} when it
-- took over a lock a release had handed to it; {1, fence, 0, lead} when the
-- fence it issued is ahead of this node's clock by lead ms, a quarter of the
-- lease or more: see fence_issue.lua's granted); {0, pttl} when it is
-- busy, {0, pttl, now} when busy for a waiter (this node's clock in ms: a lock
-- handed over later is timed from it, see rounds.handed_over); a fourth
-- element when the key holds something no lock wrote: 1 a value of another
-- type (a list, a set...), 2 a string not in the lock's format; or 3 when it
-- is a read-write lock's (a hash: one name used as two kinds of lock). Such a key is
-- busy like any other, and the waiter can say what is in the way. A fourth
-- element 7: busy with a lock a release handed to the first in line, who has
-- it to itself for a moment ('"first_until"', see release.lua); 8: busy, and
-- this waiter stands behind another in the lock's line (the hand-over node's).
-- A semaphore's first try of a permit (engine/semaphore.py) also gives KEYS[4]
-- the semaphore's count key, KEYS[5] its line's lock key, KEYS[6] the line's
-- waiter queue key, ARGV[9] its permits (a decimal string), ARGV[10] the count
-- record's lease (ms) and ARGV[11] '1' to step aside while anyone is in line
-- (a blocking acquire: arrival order), '0' not to (a try). It returns
-- {0, 0, 0, 5, recorded} when the count recorded differs, {0, 0, 0, 6} to step
-- aside; otherwise the count is recorded (or its lease renewed, never
-- shortened) and the permit is asked for as any lock. The check and the grant
-- are one script: one round trip, and no permit taken under another count.
--#include fence_issue
--#include waiter_queue
--#include attempt
if ARGV[9] then
  local recorded = redis.call('GET', KEYS[4])
  if not recorded then
    redis.call('SET', KEYS[4], ARGV[9], 'PX', ARGV[10])
  elseif recorded ~= ARGV[9] then
    return {0, 0, 0, 5, recorded}
  elseif redis.call('PTTL', KEYS[4]) < tonumber(ARGV[10]) then
    redis.call('PEXPIRE', KEYS[4], ARGV[10])
  end
  if ARGV[11] == '1' and (redis.call('EXISTS', KEYS[5]) == 1
                          or redis.call('LLEN', KEYS[6]) > 0) then
    return {0, 0, 0, 6}
  end
end
local mine = ARGV[1] .. '|'
local queue = ARGV[6]
-- pcall: GET on a key of another type is an error, which would hide the
-- answer "busy" behind a script error (the node answered; it is not down).
-- A hash is a read-write lock's (3) only in that lock's format; any other
-- hash is a value no lock wrote (1), not a LockKindConflict.
--#include rw_format
local current = redis.pcall('GET', KEYS[1])
local foreign = 0
if type(current) == 'table' then
  foreign = 1
  if redis.call('TYPE', KEYS[1]).ok == 'hash'
      and rw_hash_is_lock(redis.call('HGETALL', KEYS[1])) then
    foreign = 3  -- a read-write lock's (rw_acquire.lua): one name, two kinds of lock
  end
elseif current and not string.find(current, '^[^|]+|%d+|') then
  foreign = 2
end
if current then
  if foreign == 0 and string.sub(current, 1, #mine) == mine then
    -- Ours already: an earlier attempt of this same acquire whose reply was
    -- lost, or a release handed the lock to this waiter (release.lua) before
    -- the waiter read that release's notice. This attempt takes it over (its
    -- number in the value: its own clean-up may then delete it, no earlier
    -- attempt's may), unless this request is itself a late one of an earlier
    -- attempt (see attempt.lua); a third element 1 says it was a hand-over.
    local fence = string.match(current, '^[^|]*|([^|]*)|')
    local this = attempt_of(ARGV[3])
    if this > 0 then
      local held = attempt_of(current)
      if held > this or -held > this then
        return {1, fence}  -- late: a later attempt has it (its reply is nobody's)
      end
      if held <= 0 then
        local owner = with_attempt(ARGV[3], -this)
        -- The first moment of a hand-over (release.lua) lasts through the
        -- takeover: the waiter still has the other nodes to ask.
        local first_until = string.match(current, ',"first_until":(%d+)[,}]')
        if first_until then
          owner = (string.gsub(owner, ',"n":', ',"first_until":' .. first_until .. ',"n":', 1))
        end
        redis.call('SET', KEYS[1], mine .. fence .. '|' .. owner, 'PX', ARGV[2])
        return {1, fence, 1}
      end
      redis.call('SET', KEYS[1], mine .. fence .. '|' .. ARGV[3], 'PX', ARGV[2])
      return {1, fence}
    end
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, fence}
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if foreign == 0 then
    -- A lock a release just handed to the first in line (release.lua's
    -- '"first_until"'): while that waiter asks the other nodes, which the
    -- release left free, nobody else's round may win there. Flag 7 makes the
    -- asker's round lost even with a quorum of grants (rounds.tally_acquire).
    local first_until = string.match(current, ',"first_until":(%d+)[,}]')
    if first_until and tonumber(first_until) > server_ms() then
      foreign = 7
    end
  end
  if queue ~= '0' then
    join_queue(KEYS[3], ARGV[8], queue, ARGV[7], pttl)
    if foreign == 0 and string.find(ARGV[8], '^[^|]*|[^|]*|') then
      -- An entry in the hand-over form: this is the hand-over node, whose line
      -- is the lock's. A waiter with someone ahead of it here does not win
      -- elsewhere either (flag 8): its retry past the gate could meet the
      -- other nodes freed by a release still on its way here, and take the
      -- lock from the first in line. The first in line keeps that retry, so
      -- a copy here that a release never reached holds nobody back for long.
      local at = redis.call('LPOS', KEYS[3], ARGV[8])
      if at and at > 0 then
        foreign = 8
      end
    end
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
local fence, now = '0', nil
if ARGV[4] == '1' then
  fence, now = issue_fence(KEYS[2], ARGV[5])
end
redis.call('SET', KEYS[1], mine .. fence .. '|' .. ARGV[3], 'NX', 'PX', ARGV[2])
return granted(fence, now, ARGV[2])
