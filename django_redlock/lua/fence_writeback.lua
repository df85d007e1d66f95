-- Shared by release.lua and extend.lua, which include it when they load.
-- Write the holder's fence (the maximum over its quorum) back to this node's
-- counter when it is higher, so that the next holder's fence is higher on
-- whichever majority it gets. The counter expires `grace` ms after this node's
-- clock passes it (see acquire.lua).
local function write_back_fence(counter_key, fence_arg, grace_arg)
  local fence = tonumber(fence_arg)
  if fence <= 0 then
    return
  end
  local last = tonumber(redis.call('GET', counter_key) or '0') or 0
  if fence > last then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local px = fence - now + tonumber(grace_arg)
    if px < 1 then px = 1 end
    redis.call('SET', counter_key, fence_arg, 'PX', string.format('%.0f', px))
  end
end
