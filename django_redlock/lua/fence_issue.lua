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
-- A grant's reply: {1, fence}, or {1, fence, 0, lead} when the fence is ahead
-- of this node's clock `now` by `lead` ms, a quarter of the lease `lease_ms`
-- or more (its counter ran ahead: a fence written back from a node whose
-- clock is ahead). The holder compares its fence with the granting nodes'
-- clocks, not only with their fences (rounds.fences_disagree): a node whose
-- counter was written ahead issues counter + 1, close to the fastest node's
-- fence, while only its clock says how long it would take to pass that fence
-- alone. A smaller lead (grants in one millisecond) is not worth the longer
-- reply: the holder's estimate is then short by less than a quarter of the
-- lease, and the write-back's bound keeps its margin (rounds.FENCE_SPREAD_LIMIT).
local function granted(fence, now, lease_ms)
  if now then
    local lead = tonumber(fence) - now
    if lead * 4 >= tonumber(lease_ms) then
      return {1, fence, 0, string.format('%.0f', lead)}
    end
  end
  return {1, fence}
end
