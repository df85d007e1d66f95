-- Shared by rw_common.lua (the read-write lock's scripts) and acquire.lua:
-- whether a hash (`all`, its HGETALL) is a read-write lock's, every field
-- named like a holder ('r.<token>' / 'w.<token>') and valued in the lock's
-- format ('<expiry ms>|<fence>|<owner>'). A hash some other code wrote at the
-- lock's name (a user's profile: name, visits...) is not: rw_acquire.lua took
-- every field of one for an expired holder (no leading expiry reads as 0),
-- deleted the user's data and granted itself the lock; a field holding a
-- large number counted as a holder that never expires. Such a hash is busy
-- with a foreign value (code 1), like any value no lock wrote.
local function rw_hash_is_lock(all)
  for i = 1, #all, 2 do
    if not string.find(all[i], '^[rw]%.[^|]+$')
        or not string.find(all[i + 1], '^%d+|%d+|') then
      return false
    end
  end
  return true
end
