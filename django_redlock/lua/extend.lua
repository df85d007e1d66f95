-- Extend a lock on one node: compare-and-pexpire.
-- KEYS[1] lock key, KEYS[2] fencing counter key
-- ARGV[1] holder token, ARGV[2] new lease in ms, ARGV[3] the holder's fence,
-- ARGV[4] counter grace in ms
-- Returns 1 when the key is ours and now has the new lease, 0 otherwise.
local mine = ARGV[1] .. '|'
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #mine) ~= mine then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local fence = tonumber(ARGV[3])
if fence > 0 then
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if fence > last then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local px = fence - now + tonumber(ARGV[4])
    if px < 1 then px = 1 end
    redis.call('SET', KEYS[2], ARGV[3], 'PX', string.format('%.0f', px))
  end
end
return 1
