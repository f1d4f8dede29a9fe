-- tollgate sliding window counter, a port of src/limit/algo/sliding.rs (same formulas, exact
-- integer comparison). All times are integer microseconds; windows are aligned to the epoch.
--
-- KEYS[1]  state: a string "start:prev:cur" (window start in µs since the unix epoch, units)
-- ARGV[1]  op: "d" decide | "p" peek (decide, write nothing) | "r" refund | "b" debit (cur += c, at most 2L)
-- ARGV[2]  cost c (units)
-- ARGV[3]  W: window (µs)
-- ARGV[4]  L: limit (units per window)
-- ARGV[5]  deadline (µs, Redis TIME; 0 = none): a writing call run past it changes nothing, answers {3, now}
-- ARGV[6]  optional now (µs) — tests only; production omits it and the script reads TIME
-- Reply "d": {kind, retry_after, remaining, reset, granted, now} (kind 0 allow, 2 deny; µs, units)
-- Reply "r", "b": {0, now}
-- Writes: SET with PX = time until neither counter weighs (start + 2W if cur > 0, else
-- start + W), or DEL.
local op, key = ARGV[1], KEYS[1]
local c, wl, l = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now, test = clock_us(6)
if late(5, now, test) then return {3, now} end

local start, prev, cur = 0, 0, 0
local v = redis.call('GET', key)
if v then
  local i = string.find(v, ':', 1, true)
  local j = string.find(v, ':', i + 1, true)
  start = tonumber(string.sub(v, 1, i - 1))
  prev, cur = tonumber(string.sub(v, i + 1, j - 1)), tonumber(string.sub(v, j + 1))
end
-- Roll to now; a clock that steps back stays in the stored window (lag is added back).
local n = math.max(now, start)
local ws = idiv(n, wl) * wl
if ws ~= start then
  if start + wl == ws then prev = cur else prev = 0 end
  cur, start = 0, ws
end
local rest, lag = wl - (n - ws), n - now

local function reset()
  if cur > 0 then return rest + wl + lag elseif prev > 0 then return rest + lag end
  return lag
end

local function store()
  local idle_at = start + wl
  if cur > 0 then idle_at = start + 2 * wl elseif prev == 0 then idle_at = 0 end
  put(key, idle_at - now, num(start) .. ':' .. num(prev) .. ':' .. num(cur), test)
end

if op == 'r' then
  cur = math.max(cur - c, 0)
  store()
  return {0, now}
end
if op == 'b' then
  cur = math.min(cur + c, 2 * l)
  store()
  return {0, now}
end

local weighted = prev * rest
if weighted + (cur + c) * wl <= l * wl then
  cur = cur + c
  store()
  return {0, 0, math.max(idiv(l * wl - weighted, wl) - cur, 0), reset(), c, now}
end
-- Smallest wait after which the same request fits: first within this window ...
local ra
local spare = l - cur - c
if spare >= 0 and prev > 0 then
  local fit = idiv(spare * wl, prev)
  if fit > 0 then ra = rest - math.min(fit, rest) end
end
-- ... else in the next one, where prev' = cur.
if not ra then
  local e2 = 0
  if cur > 0 then e2 = wl - math.min(wl, idiv((l - c) * wl, cur)) end
  ra = rest + e2
end
return {2, ra + lag, 0, reset(), 0, now}
