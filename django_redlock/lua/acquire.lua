-- Acquire a lock on one node, in one round trip.
-- KEYS[1] lock key, KEYS[2] fencing counter key
-- ARGV[1] holder token, ARGV[2] lease in ms, ARGV[3] owner JSON,
-- ARGV[4] '1' to issue a fencing token, ARGV[5] counter grace in ms
-- Returns {1, fence} when this holder now has the key, {0, pttl} when it is busy.
local mine = ARGV[1] .. '|'
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, #mine) == mine then
    -- Ours already: an earlier attempt of this same acquire whose reply was lost.
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, string.match(current, '^[^|]*|([^|]*)|')}
  end
  return {0, redis.call('PTTL', KEYS[1])}
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
