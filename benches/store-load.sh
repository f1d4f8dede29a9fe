#!/usr/bin/env bash
# The issue 7 store rows through the proxy, with public tools (redis-server, nginx, wrk):
#
#   benches/store-load.sh            # both parts; PART=redis or PART=keys for one
#
# redis: tollgate `bench` with its limit in-process, in a local redis-server (one Lua call per
#        decision) and with `lease: 100`, interleaved by benches/ab.sh (proxy and upstream on
#        core 0, wrk on core 1, redis-server on REDIS_CORE: 1 by default, as a Redis node on
#        its own machine would not share the proxy's core; REDIS_CORE=0 charges its work to
#        the proxy's core). Prints req/s and CPU per request of each.
# keys:  one tollgate trusts X-Forwarded-For from loopback and wrk's Lua script sends up to
#        KEYS (1000000) client addresses, so the token bucket keeps that many live keys
#        (rate 1/h: a key lives an hour after its request). Prints RSS before and after, and
#        CPU per request with one hot key and across all the keys.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD part=${PART:-all} keys=${KEYS:-1000000}
for t in nginx wrk taskset redis-server redis-cli; do
  command -v $t >/dev/null || { echo "missing $t (apt-get install nginx wrk redis-server)" >&2; exit 1; }
done
cargo build --profile dist --quiet
bin=$root/target/dist/tollgate
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

if [[ $part == all || $part == redis ]]; then
  port=$(free_port)
  taskset -c "${REDIS_CORE:-1}" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --pidfile "$work/redis.pid" --logfile "$work/redis.log"
  until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.1; done
  url=redis://127.0.0.1:$port
  ROUNDS=${ROUNDS:-3} DURATION=${DURATION:-8s} benches/ab.sh "$bin" "BENCH_REDIS_URL=$url $bin" \
    "BENCH_REDIS_URL=$url BENCH_LEASE=100 $bin"
  echo "redis: $(redis-cli -p "$port" info commandstats | grep -E 'evalsha|eval:' | tr -d '\r')"
  kill "$(cat "$work/redis.pid")"; rm "$work/redis.pid"
fi

if [[ $part == all || $part == keys ]]; then
  start_upstream "$work" 18190 0
  cat > "$work/spread.lua" <<LUA
-- X-Forwarded-For cycles through $keys addresses in 10.0.0.0/8.
local n, keys = 0, $keys
request = function()
  n = (n + 1) % keys
  local ip = string.format("10.%d.%d.%d", math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
  return wrk.format(nil, nil, { ["X-Forwarded-For"] = ip })
end
LUA
  cat > "$work/hot.lua" <<LUA
request = function() return wrk.format(nil, nil, { ["X-Forwarded-For"] = "10.255.255.255" }) end
LUA
  admin=127.0.0.1:$(free_port)
  UPSTREAM_ADDR=127.0.0.1:18190 LISTEN_ADDR=127.0.0.1:18195 BENCH_TRUSTED_PROXIES=127.0.0.1/32 BENCH_RATE=1/h \
    BENCH_BURST=1000000 BENCH_ADMIN=$admin taskset -c 0 "$bin" bench &
  echo $! > "$work/tollgate.pid"
  pid=$(cat "$work/tollgate.pid")
  sleep 1
  rss() { awk '/VmRSS/{print $2}' "/proc/$pid/status"; }
  cpu() { awk '{print $14+$15}' "/proc/$pid/stat"; }
  hz=$(getconf CLK_TCK)
  measure() { # label script duration
    local before after out reqs
    before=$(cpu); out=$(taskset -c 1 wrk -t1 -c50 -d"$3" -s "$2" http://127.0.0.1:18195/); after=$(cpu)
    reqs=$(awk '/requests in/{print $1}' <<<"$out")
    printf '%-34s %9s req/s %6s us/req  rss %s KiB\n' "$1" "$(awk '/Requests\/sec/{printf "%.0f", $2}' <<<"$out")" \
      "$(awk -v t=$((after - before)) -v n="$reqs" -v hz="$hz" 'BEGIN{printf "%.1f", t * 1e6 / hz / n}')" "$(rss)"
  }
  taskset -c 1 wrk -t1 -c50 -d2s -s "$work/hot.lua" http://127.0.0.1:18195/ >/dev/null
  base=$(rss)
  # Fill: every address once (wrk runs until the counter has wrapped at least once).
  rate=$(taskset -c 1 wrk -t1 -c50 -d3s -s "$work/spread.lua" http://127.0.0.1:18195/ | awk '/Requests\/sec/{printf "%d", $2}')
  fill=$(( keys / (rate > 0 ? rate : 1) + 5 ))
  taskset -c 1 wrk -t1 -c50 -d"${fill}s" -s "$work/spread.lua" http://127.0.0.1:18195/ >/dev/null
  live=$(curl -s "http://$admin/metrics" | awk '/^tollgate_local_store_keys/{print $2}')
  # Interleaved rounds: the machine's noise hits both alike.
  for r in $(seq "${ROUNDS:-3}"); do
    measure "round $r: spread over $keys keys" "$work/spread.lua" 8s
    measure "round $r: hot key ($keys live)" "$work/hot.lua" 8s
  done
  echo "rss: $base KiB with one key, $(rss) KiB after $keys keys: +$(( ($(rss) - base) / 1024 )) MiB; live keys after the fill: $live"
fi
