-- Extend many locks on one node in one call: the renewal thread's batch.
-- KEYS: lock key 1, fencing counter key 1, lock key 2, counter key 2, ...
-- ARGV[1] counter grace in ms, then per lock: holder token, new lease in ms,
-- the holder's fence.
-- Returns one integer per lock, in order: 1 when the key was ours and now has
-- at least the new lease (never shortened, see extend.lua), 0 otherwise
-- (exactly what extend.lua, or rw_extend.lua for a read-write lock's holder,
-- returns for each).
--#include fence_writeback
--#include rw_common
local grace = ARGV[1]
local out = {}
for i = 1, #KEYS / 2 do
  local key, counter = KEYS[2 * i - 1], KEYS[2 * i]
  local token, lease, fence = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  if string.sub(token, 2, 2) == '.' then  -- 'r.' / 'w.': a read-write lock's holder
    out[i] = rw_extend(key, token, lease)
  else
    local mine = token .. '|'
    local current = redis.pcall('GET', key)  -- (an error on a key of another type)
    if type(current) == 'string' and string.sub(current, 1, #mine) == mine then
      if redis.call('PTTL', key) < tonumber(lease) then
        redis.call('PEXPIRE', key, lease)
      end
      out[i] = 1
    else
      out[i] = 0
    end
  end
  if out[i] == 1 then
    write_back_fence(counter, fence, grace)
  end
end
return out
