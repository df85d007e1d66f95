-- Delete a lock whoever holds it (operator's `locks release --force`), and wake
-- the waiters. KEYS[1] lock key. Returns the deleted value (a read-write
-- lock's: one of its holders' values), or false.
local kind = redis.call('TYPE', KEYS[1]).ok
local current = false
if kind == 'string' then
  current = redis.call('GET', KEYS[1])
elseif kind == 'hash' then
  local all = redis.call('HGETALL', KEYS[1])
  if #all > 0 then
    current = all[1] .. '|' .. string.match(all[2], '^%d+|(.*)$')
  end
end
if current then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], 'released')
end
return current
