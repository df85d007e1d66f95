-- Delete a lock whoever holds it (operator's `locks release --force`), and wake
-- the waiters. KEYS[1] lock key. Returns the deleted value, or false.
local current = redis.call('GET', KEYS[1])
if current then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], 'released')
end
return current
