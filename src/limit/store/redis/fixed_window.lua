-- tollgate fixed window counter, a port of src/limit/algo/fixed.rs (same formulas).
-- All times are integer microseconds; windows are aligned to the epoch (start = n - n % W).
--
-- KEYS[1]  state: a string "start:count" (window start in µs since the unix epoch, units)
-- ARGV[1]  op: "d" decide | "r" refund
-- ARGV[2]  cost c (units)
-- ARGV[3]  W: window (µs)
-- ARGV[4]  L: limit (units per window)
-- ARGV[5]  optional now (µs) — tests only; production omits it and the script reads TIME
-- Reply "d": {kind, retry_after, remaining, reset, granted} (kind 0 allow, 2 deny; µs, units)
-- Reply "r": 0
-- Writes: SET with PX = start + W - now (the window's end), or DEL.
local op, key = ARGV[1], KEYS[1]
local c, wl, l = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now, test = clock_us(5)

local start, count = 0, 0
local v = redis.call('GET', key)
if v then
  local i = string.find(v, ':', 1, true)
  start, count = tonumber(string.sub(v, 1, i - 1)), tonumber(string.sub(v, i + 1))
end
-- A clock that steps back stays in the stored window (never reopens a fresh one).
local ws = idiv(math.max(now, start), wl) * wl
if ws ~= start then start, count = ws, 0 end
local left = ws + wl - now

local function store()
  put(key, count > 0 and left or 0, num(start) .. ':' .. num(count), test)
end

if op == 'r' then
  count = math.max(count - c, 0)
  store()
  return 0
end

if count + c <= l then
  count = count + c
  store()
  local reset = 0
  if count > 0 then reset = left end
  return {0, 0, l - count, reset, c}
end
return {2, left, 0, left, 0}
