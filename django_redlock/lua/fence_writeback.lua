-- Shared by release.lua, extend.lua, extend_many.lua, rw_release.lua and
-- rw_extend.lua, which include it when they load.
-- Write the holder's fence (the maximum over its quorum) back to this node's
-- counter when it is higher, so that the next holder's fence is higher on
-- whichever majority it gets. The counter expires `grace` ms after this node's
-- clock passes it (see acquire.lua).
-- A counter of another type (a list some other code wrote at the key) is left
-- alone, and the caller goes on: GET's WRONGTYPE error failed the whole
-- script, and in extend_many.lua that is the whole renewal batch, every lock
-- of the process on this node (up to EXTEND_BATCH) lost for one lock's
-- counter, and in release.lua the release after its DEL. The holder's own key
-- is what says it holds the lock; the next acquire, which issues a fence from
-- this counter, is the one that cannot go on, and names the key
-- (rounds.refused).
local function write_back_fence(counter_key, fence_arg, grace_arg)
  local fence = tonumber(fence_arg)
  if fence <= 0 then
    return
  end
  local stored = redis.pcall('GET', counter_key)
  if type(stored) == 'table' then
    return  -- WRONGTYPE: not a counter any lock wrote
  end
  local last = tonumber(stored or '0') or 0
  if fence > last then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local px = fence - now + tonumber(grace_arg)
    if px < 1 then px = 1 end
    redis.call('SET', counter_key, fence_arg, 'PX', string.format('%.0f', px))
  end
end
