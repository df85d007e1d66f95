-- Release a lock on one node: compare-and-delete, then wake the waiters.
-- KEYS[1] lock key, KEYS[2] fencing counter key
-- ARGV[1] holder token, ARGV[2] the holder's fence ('0' when unfenced),
-- ARGV[3] counter grace in ms, ARGV[4] '1' to wake the waiters ('0' for the
-- clean-up after a lost attempt: waking every waiter for a lock that was never
-- held only makes them all race again)
-- Returns 0 when the key was not ours (never touches others' keys), else 1 + the
-- number of subscribers the release notice reached.
local mine = ARGV[1] .. '|'
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #mine) ~= mine then
  return 0
end
redis.call('DEL', KEYS[1])
local fence = tonumber(ARGV[2])
if fence > 0 then
  -- Write the holder's fence (the maximum over its quorum) back, so that the next
  -- holder's fence is higher on whichever majority it gets.
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if fence > last then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local px = fence - now + tonumber(ARGV[3])
    if px < 1 then px = 1 end
    redis.call('SET', KEYS[2], ARGV[2], 'PX', string.format('%.0f', px))
  end
end
if ARGV[4] == '1' then
  -- 1 + how many subscribers heard it: the releaser learns whether anyone waits.
  return 1 + redis.call('PUBLISH', KEYS[1], 'released')
end
return 1
