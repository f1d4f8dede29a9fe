-- tollgate token bucket: GCRA with optional linear warm-up, a port of src/limit/algo/gcra.rs
-- (same formulas, same rounding). All times are integer microseconds.
--
-- KEYS[1]  state: a string "tat" (no warm-up) or "tat:start" (µs since the unix epoch), or
--          for a plan limit "tat:start:per" (per: the interval tat was charged at, µs)
-- ARGV[1]  op: "d" decide | "p" peek (decide, write nothing) | "l" lease (take at least ARGV[2], at most ARGV[6] units) | "r" refund
--          | "b" debit (charge c more, tat may pass now + B*T, at most now + 2^51)
-- ARGV[2]  cost c (units)
-- ARGV[3]  T: interval (µs per unit)
-- ARGV[4]  B: burst (units)
-- ARGV[5]  W: warm-up (µs, 0 = off)
-- ARGV[6]  N: lease size (units; read by "l" only)
-- ARGV[7]  plan: "1" for a plan limit (the interval differs per client tier; a state charged at
--          another interval is carried over: units owed = ceil((tat - now) / per), tat = now +
--          units * T, at most now + 2^51), else "0"
-- ARGV[8]  deadline (µs, Redis TIME; 0 = none): a writing call run past it changes nothing, answers {3, now}
-- ARGV[9]  optional now (µs) — tests only; production omits it and the script reads TIME
-- Reply "d"/"l": {kind, retry_after, remaining, reset, granted, now} (kind 0 allow, 2 deny; µs, units)
-- Reply "r", "b": {0, now}
-- Writes: SET with PX = time until the state is initial again (tat + W - now), or DEL.
local op, key = ARGV[1], KEYS[1]
local c, t, b, w, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local plan = ARGV[7] == '1'
local now, test = clock_us(9)
if late(8, now, test) then return {3, now} end

local tat, start, per = 0, 0, 0
local v = redis.call('GET', key)
if v then
  local i = string.find(v, ':', 1, true)
  if i then
    tat = tonumber(string.sub(v, 1, i - 1))
    local j = string.find(v, ':', i + 1, true)
    if j then
      start, per = tonumber(string.sub(v, i + 1, j - 1)), tonumber(string.sub(v, j + 1))
    else
      start = tonumber(string.sub(v, i + 1))
    end
  else
    tat = tonumber(v)
  end
end
if per > 0 and per ~= t and tat > now then
  tat = now + math.min(idiv(tat - now + per - 1, per) * t, 2251799813685248)
end

local function cold(x) return x == 0 or x + w <= now end

-- µs charged per unit for a key warming up since s (3T cold → T after W).
local function charge(s)
  if w == 0 then return t end
  return idiv(3 * t * w, w + 2 * math.min(math.max(now - s, 0), w))
end

local function store(x, s)
  local val = num(x)
  if plan then
    val = val .. ':' .. num(s) .. ':' .. num(t)
  elseif w > 0 then
    val = val .. ':' .. num(s)
  end
  put(key, x > 0 and (x + w - now) or 0, val, test)
end

if op == 'r' then
  if tat <= now then return {0, now} end
  tat = math.max(tat - c * charge(start), now)
  if tat <= now and start == now then tat = 0 end -- refunded a cold start: cold again
  store(tat, start)
  return {0, now}
end

if op == 'b' then
  local st = start
  if cold(tat) then st = now end
  store(math.min(math.max(tat, now) + c * charge(st), now + 2251799813685248), st)
  return {0, now}
end

local tau = b * t
local tat0 = math.max(tat, now)
local st = start
if cold(tat) then st = now end
local late = tat0 + c * t - now
if late > tau then
  return {2, late - tau, 0, math.max(tat - now, 0), 0, now}
end
local k = c
if op == 'l' then k = math.max(c, math.min(n, idiv(tau - (tat0 - now), t))) end
tat = tat0 + k * charge(st)
local slack = now + tau - math.max(tat, now)
local rem = 0
if slack >= t then
  local s2 = st
  if cold(tat) then s2 = now end
  rem = 1 + idiv(slack - t, math.max(charge(s2), 1))
end
store(tat, st)
return {0, 0, rem, math.max(tat - now, 0), k, now}
