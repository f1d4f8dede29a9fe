-- tollgate leaky bucket (a meter with a bounded queue), a port of src/limit/algo/leaky.rs
-- (same formulas, same rounding). All times are integer microseconds.
--
-- KEYS[1]  state: a string "tat", the time the next slot is free (µs since the unix epoch)
-- ARGV[1]  op: "d" decide | "p" peek (decide, write nothing) | "r" refund | "b" debit (tat += c*T, at most now + 2^51)
-- ARGV[2]  cost c (units)
-- ARGV[3]  T: interval (µs per unit)
-- ARGV[4]  D: max_delay (µs, 0 = strict meter)
-- ARGV[5]  deadline (µs, Redis TIME; 0 = none): a writing call run past it changes nothing, answers {3, now}
-- ARGV[6]  optional now (µs) — tests only; production omits it and the script reads TIME
-- Reply "d": {kind, wait_or_retry_after, remaining, reset, granted, now}
--            (kind 0 allow, 1 delay by `wait`, 2 deny; µs, units)
-- Reply "r", "b": {0, now}
-- Writes: SET with PX = tat - now (the queue drains then), or DEL.
local op, key = ARGV[1], KEYS[1]
local c, t, d = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now, test = clock_us(6)
if late(5, now, test) then return {3, now} end

local function store(x)
  put(key, x - now, num(x), test)
end

local tat = tonumber(redis.call('GET', key) or '0')

if op == 'r' then
  if tat > now then store(math.max(tat - c * t, now)) end
  return {0, now}
end
if op == 'b' then
  store(math.min(math.max(tat, now) + c * t, now + 2251799813685248))
  return {0, now}
end

local slot = math.max(tat, now)
local wait = slot - now
if wait > d then
  return {2, wait - d, 0, wait, 0, now}
end
tat = slot + c * t
local reset = tat - now
local rem = 0
if reset <= d then rem = idiv(d - reset, t) + 1 end
store(tat)
if wait == 0 then return {0, 0, rem, reset, c, now} end
return {1, wait, rem, reset, c, now}
