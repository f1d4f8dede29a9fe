-- tollgate sliding log, a port of src/limit/algo/log.rs (same formulas). Exact, but O(limit)
-- memory and O(entries) work per call: prefer the sliding window counter for large limits.
--
-- KEYS[1]  state: a ZSET, one member "ts:cost" per admitted µs (score = ts, µs since the epoch)
-- ARGV[1]  op: "d" decide | "p" peek (decide, write nothing) | "r" refund | "b" debit (record c more, the sum at most 2^51)
-- ARGV[2]  cost c (units)
-- ARGV[3]  W: window (µs)
-- ARGV[4]  L: limit (units per window)
-- ARGV[5]  deadline (µs, Redis TIME; 0 = none): a writing call run past it changes nothing, answers {3, now}
-- ARGV[6]  optional now (µs) — tests only; production omits it and the script reads TIME
-- Reply "d": {kind, retry_after, remaining, reset, granted, now} (kind 0 allow, 2 deny; µs, units)
-- Reply "r", "b": {0, now}
-- Writes: ZADD/ZREM, then PEXPIRE = newest ts + W - now (the log is empty then).
local op, key = ARGV[1], KEYS[1]
local c, wl, l = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now, test = clock_us(6)
if late(5, now, test) then return {3, now} end

local function f(x) return string.format('%.0f', x) end
local function member(ts, cost) return f(ts) .. ':' .. f(cost) end

-- Read the log (sorted by ts) and drop what left the window: ts + W <= now.
local ts, cs, sum, dropped = {}, {}, 0, false
for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
  local i = string.find(m, ':', 1, true)
  local t, cost = tonumber(string.sub(m, 1, i - 1)), tonumber(string.sub(m, i + 1))
  if t + wl <= now then
    dropped = true
  else
    ts[#ts + 1], cs[#cs + 1], sum = t, cost, sum + cost
  end
end
if dropped then write('ZREMRANGEBYSCORE', key, '-inf', f(now - wl)) end

local function reset()
  if #ts == 0 then return 0 end
  return math.max(ts[#ts] + wl - now, 0)
end

local function expire()
  local r = reset()
  if r > 0 then
    local ms = math.floor((r + 999) / 1000)
    if test and ms < 60000 then ms = 60000 end
    write('PEXPIRE', key, ms)
  end
end

if op == 'r' then
  local left = c
  while left > 0 and #ts > 0 do
    local last = #ts
    local take = math.min(left, cs[last])
    write('ZREM', key, member(ts[last], cs[last]))
    left, cs[last] = left - take, cs[last] - take
    if cs[last] == 0 then
      ts[last], cs[last] = nil, nil
    else
      write('ZADD', key, f(ts[last]), member(ts[last], cs[last]))
    end
  end
  expire()
  return {0, now}
end

if op == 'b' then c = math.max(math.min(c, 2251799813685248 - sum), 0) end
if op == 'b' or sum + c <= l then
  if c > 0 then
    local last = #ts
    -- max(now, newest ts) keeps the log sorted if the clock steps back.
    local at = now
    if last > 0 and ts[last] > at then at = ts[last] end
    if last > 0 and ts[last] == at then
      write('ZREM', key, member(ts[last], cs[last]))
      cs[last] = cs[last] + c
    else
      last = last + 1
      ts[last], cs[last] = at, c
    end
    write('ZADD', key, f(at), member(at, cs[last]))
    sum = sum + c
    expire()
  end
  if op == 'b' then return {0, now} end
  return {0, 0, l - sum, reset(), c, now}
end
-- Denied: wait until enough of the oldest entries have left the window.
local need, freed, ra = sum + c - l, 0, 0
for i = 1, #ts do
  freed = freed + cs[i]
  if freed >= need then
    ra = ts[i] + wl - now
    break
  end
end
return {2, ra, 0, reset(), 0, now}
