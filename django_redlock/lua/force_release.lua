-- Delete a lock whoever holds it (operator's `locks release --force`), and wake
-- the waiters. KEYS[1] lock key; ARGV (optional, any number) channels to
-- publish the key on as well, where a family's waiters listen for a free
-- member (a segment's or a permit's: core.keys.free_channels). Returns the
-- deleted value (a read-write lock's: one of its holders' values), or false.
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
  for i = 1, #ARGV do
    redis.call('PUBLISH', ARGV[i], KEYS[1])
  end
end
return current
