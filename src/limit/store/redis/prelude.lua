-- tollgate script prelude, prepended to every algorithm script at build time (a Redis script
-- cannot include another). Defines:
--   clock_us(i) -> now, test: ARGV[i] in µs when given (tests only), else Redis TIME in µs
--   idiv(x, y): exact floor(x / y) for integers below 2^53 (the double quotient is off by at
--               most one, so it is corrected in both directions)
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

