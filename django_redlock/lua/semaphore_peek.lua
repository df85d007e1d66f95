-- Read a semaphore's permits for the head of its line (engine/semaphore.py's
-- Peek), changing nothing: KEYS the permits' lock keys; returns each one's
-- PTTL in ms (-2: absent, so it may be free; -1: a key without expiry).
-- One round trip instead of one acquire attempt per busy permit.
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('PTTL', KEYS[i])
end
return out
