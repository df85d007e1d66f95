-- Extend a read-write lock's holder on one node. KEYS and ARGV as extend.lua's;
-- returns 1 when the holder was there and now has at least the new lease (never
-- shortened, see extend.lua), 0 otherwise.
--#include fence_writeback
--#include rw_common
local held = rw_extend(KEYS[1], ARGV[1], ARGV[2])
if held == 1 then
  write_back_fence(KEYS[2], ARGV[3], ARGV[4])
end
return held
