-- Acquire a lock on one node, in one round trip.
-- KEYS[1] lock key, KEYS[2] fencing counter key, KEYS[3] waiter queue key
-- ARGV[1] holder token, ARGV[2] lease in ms, ARGV[3] owner JSON,
-- ARGV[4] '1' to issue a fencing token, ARGV[5] counter grace in ms,
-- ARGV[6] the waiter queue: '0' leave it alone (a first attempt), '1' join at
-- the back when busy, '2' join at the front (a waiter that was just woken and
-- lost the race keeps its place); ARGV[7] how long the queue outlives the lock
-- (ms); ARGV[8] the waiter's queue entry, '<inbox channel>|<token>'
-- Returns {1, fence} when this holder now has the key, {0, pttl} when it is busy.
local mine = ARGV[1] .. '|'
local queue = ARGV[6]
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, #mine) == mine then
    -- Ours already: an earlier attempt of this same acquire whose reply was lost.
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, string.match(current, '^[^|]*|([^|]*)|')}
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if queue ~= '0' then
    -- Wait in line once: a waiter retrying on its timer is already queued.
    if not redis.call('LPOS', KEYS[3], ARGV[8]) then
      if queue == '2' then
        redis.call('LPUSH', KEYS[3], ARGV[8])
      else
        redis.call('RPUSH', KEYS[3], ARGV[8])
      end
    end
    local keep = tonumber(ARGV[7])
    if pttl > 0 then keep = keep + pttl end
    redis.call('PEXPIRE', KEYS[3], keep)
  end
  return {0, pttl}
end
if queue ~= '0' then
  redis.call('LREM', KEYS[3], 0, ARGV[8])  -- served: out of the line
end
local fence = '0'
if ARGV[4] == '1' then
  -- fence = max(counter + 1, now in ms): it grows with every acquisition, and it
  -- keeps growing after the counter expired or the node restarted empty, because
  -- the counter only expires once the clock has passed it by the grace period.
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local nxt = (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) + 1
  if now > nxt then nxt = now end
  fence = string.format('%.0f', nxt)
  redis.call('SET', KEYS[2], fence, 'PX', string.format('%.0f', nxt - now + tonumber(ARGV[5])))
end
redis.call('SET', KEYS[1], mine .. fence .. '|' .. ARGV[3], 'NX', 'PX', ARGV[2])
return {1, fence}
