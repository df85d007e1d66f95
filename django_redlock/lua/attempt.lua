-- Shared by acquire.lua, release.lua, rw_acquire.lua and rw_release.lua: which
-- attempt of an acquire wrote a lock value, so that a late request of an
-- earlier attempt can never undo a later one's work on this node.
-- One holder token serves every attempt of one acquire() call, and each
-- attempt may leave requests behind that the node runs late (a connection
-- dropped after a timeout: what it sent still runs when the node reads it,
-- possibly after a newer connection's requests). The attempt's number is the
-- owner's last field, '"n":<k>' (core/owner.py, rounds.attempt_owner):
--   k > 0   written (or taken over) by attempt k;
--   0       handed over by someone's release (release.lua writes the owner of
--           the waiter's queue entry, which has no number), or an older version;
--   -k      a hand-over taken over by attempt k (acquire.lua).
local function attempt_of(value)
  return tonumber(string.match(value, ',"n":(%-?%d+)}$')) or 0
end
-- `owner` (which ends with '"n":<k>}') with the number `n` instead.
local function with_attempt(owner, n)
  return (string.gsub(owner, ',"n":%-?%d+}$', ',"n":' .. string.format('%d', n) .. '}'))
end
-- Whether a clean-up of attempt `limit` may delete a value written by attempt
-- `held` (attempt_of): a plain clean-up (limit k > 0) deletes only what
-- attempts up to k wrote; the clean-up of a hand-over taken in attempt k
-- (limit -k) only a hand-over not taken over by a later attempt. A hand-over
-- nobody took over (0) is never a plain clean-up's: the waiter holds it when
-- it reads the notice.
local function cleanup_may_delete(held, limit)
  if limit > 0 then
    return held > 0 and held <= limit
  end
  return held <= 0 and -held <= -limit
end
