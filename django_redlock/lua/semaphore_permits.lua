-- The permit count of a semaphore on one node: record it, or compare with it.
-- KEYS[1] the semaphore's count key, ARGV[1] the caller's permits (a decimal
-- string), ARGV[2] the record's lease in ms.
-- The first caller records its count (SET NX); every caller that agrees renews
-- the lease (never shortens it); the reply is the count recorded, so a caller
-- whose count differs learns it before it takes a permit. The check and the
-- write are one script: two callers with different counts cannot both record.
local current = redis.call('GET', KEYS[1])
if not current then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
if current == ARGV[1] and redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return current
