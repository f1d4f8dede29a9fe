-- tollgate fixed window counter, a port of src/limit/algo/fixed.rs (same formulas).
-- All times are integer microseconds; windows are aligned to the epoch (start = n - n % W),
-- or to a calendar (hour, day, month in a time zone) whose boundaries the caller passes.
--
-- KEYS[1]  state: a string "start:count" (window start in µs since the unix epoch, units)
-- ARGV[1]  op: "d" decide | "p" peek (decide, write nothing) | "r" refund | "b" debit (count += c, past L if need be)
-- ARGV[2]  cost c (units)
-- ARGV[3]  W: window (µs)
-- ARGV[4]  L: limit (units per window)
-- ARGV[5..7] b0, b1, b2 (µs): calendar boundaries around the caller's clock, b0 <= b1 <= b2
--          (the window [b0, b1) and the next [b1, b2)); all 0 for epoch-aligned windows
-- ARGV[8]  deadline (µs, Redis TIME; 0 = none): a writing call run past it changes nothing, answers {3, now}
-- ARGV[9]  optional now (µs) — tests only; production omits it and the script reads TIME
-- Reply "d": {kind, retry_after, remaining, reset, granted, now} (kind 0 allow, 2 deny; µs, units)
-- Reply "r", "b": {0, now}
-- Writes: SET with PX = window end - now, or DEL.
local op, key = ARGV[1], KEYS[1]
local c, wl, l = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local b0, b1, b2 = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now, test = clock_us(9)
if late(8, now, test) then return {3, now} end

local start, count = 0, 0
local v = redis.call('GET', key)
if v then
  local i = string.find(v, ':', 1, true)
  start, count = tonumber(string.sub(v, 1, i - 1)), tonumber(string.sub(v, i + 1))
end
-- A clock that steps back stays in the stored window (never reopens a fresh one).
local n = math.max(now, start)
local ws, we
if b1 == 0 then
  ws = idiv(n, wl) * wl
  we = ws + wl
elseif n < b1 then
  -- Before b0 only when Redis' clock is behind the caller's: count it in the caller's window.
  ws, we = b0, b1
else
  ws, we = b1, b2
end
if ws ~= start then start, count = ws, 0 end
local left = we - now

local function store()
  put(key, count > 0 and left or 0, num(start) .. ':' .. num(count), test)
end

if op == 'r' then
  count = math.max(count - c, 0)
  store()
  return {0, now}
end
if op == 'b' then
  count = math.min(count + c, 2251799813685248)
  store()
  return {0, now}
end

if count + c <= l then
  count = count + c
  store()
  local reset = 0
  if count > 0 then reset = left end
  return {0, 0, l - count, reset, c, now}
end
return {2, left, 0, left, 0, now}
