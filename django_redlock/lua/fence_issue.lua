-- Shared by acquire.lua and release.lua (the release hands the lock to the
-- next waiter on one node, so it issues that waiter's fence).
-- This node's clock in ms (TIME is allowed: scripts replicate their effects).
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- fence = max(counter + 1, now in ms): it grows with every acquisition, and it
-- keeps growing after the counter expired or the node restarted empty, because
-- the counter only expires once the clock has passed it by the grace period.
-- Returns the fence (a decimal string) and the clock it read.
local function issue_fence(counter_key, grace_arg)
  local now = server_ms()
  local nxt = (tonumber(redis.call('GET', counter_key) or '0') or 0) + 1
  if now > nxt then nxt = now end
  local fence = string.format('%.0f', nxt)
  redis.call('SET', counter_key, fence, 'PX', string.format('%.0f', nxt - now + tonumber(grace_arg)))
  return fence, now
end
