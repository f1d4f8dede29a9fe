-- tollgate script prelude, prepended to every algorithm script at build time (a Redis script
-- cannot include another). Defines:
--   clock_us(i) -> now, test: ARGV[i] in µs when given (tests only), else Redis TIME in µs
--   idiv(x, y): exact floor(x / y) for integers below 2^53 (the double quotient is off by at
--               most one, so it is corrected in both directions)
--   num(x): an integer as its decimal string (no exponent)
--   put(key, left, val, test): SET key val with PX = left µs rounded up to ms, or DEL when
--               left <= 0 (the state is back to initial). Under a test clock, which runs apart
--               from Redis' own expiry clock, keys live at least 60 s. Nothing under "p".
--   write(...): redis.call(...) of a write, skipped under "p"
--   peek: op "p" (peek): decide as "d" would, and write nothing (the admin listener's read)
--   late(i, now, test): true for a writing call (every op but "p") that Redis runs past
--               ARGV[i], the call's deadline in Redis TIME µs (0: none; never under a test
--               clock): its caller has given up on it and decided without Redis, so it must
--               change nothing. Such a call answers {3, now}.
-- Every reply ends with `now`, Redis' time of the call (the caller estimates its clock from it).
local function clock_us(i)
  local given = tonumber(ARGV[i])
  if given then return given, true end
  local tm = redis.call('TIME')
  return tonumber(tm[1]) * 1000000 + tonumber(tm[2]), false
end

local function idiv(x, y)
  local q = math.floor(x / y)
  if q * y > x then q = q - 1 elseif (q + 1) * y <= x then q = q + 1 end
  return q
end

local function num(x)
  return string.format('%.0f', x)
end

local peek = ARGV[1] == 'p'

local function write(...)
  if not peek then return redis.call(...) end
end

local function put(key, left, val, test)
  if peek then return end
  if left <= 0 then
    redis.call('DEL', key)
    return
  end
  local ms = idiv(left + 999, 1000)
  if test and ms < 60000 then ms = 60000 end
  redis.call('SET', key, val, 'PX', ms)
end


local function late(i, now, test)
  local d = tonumber(ARGV[i]) or 0
  return (not peek) and (not test) and d > 0 and now > d
end
