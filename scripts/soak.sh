#!/usr/bin/env bash
# Soak: MINUTES of mixed traffic from ~1M churning client addresses (X-Forwarded-For behind a
# trusted proxy) through one release tollgate with local and Redis-backed limits of every
# algorithm, a stale-copy cache with churning URLs, HTTP/1.1 (wrk, as fast as it goes) and h2c
# (h2load, 2000 requests a second). Not part of CI.
#
#   scripts/soak.sh 10
#
# Every 30 s it prints tollgate's RSS, live keys of the local stores, Redis keys and how many of
# them have no TTL, and the requests and failures of that slice. At the end, pass/fail:
#   - RSS plateaus: the last sample is at most 10 % (+16 MiB) above the sample at half time;
#   - Redis never holds a key without a TTL (INFO keyspace, and PTTL over a --scan sample);
#   - no failed request: every answer is 2xx or 429, no socket error, no h2 stream error.
#
# Needs: redis-server, redis-cli, wrk, h2load, curl; nginx for the upstream (else a second
# tollgate with the built-in responder). It starts its own redis-server on a free port (never
# 6379) and stops everything it started on exit.
#
# Environment: SOAK_BIN (a tollgate binary; default: cargo build --profile dist), SOAK_DIR (work
# directory, default a new one under $TMPDIR), SOAK_KEYS (client addresses, default 1048576),
# SOAK_MAX_KEYS (max_keys of the local limits, default 250000: below SOAK_KEYS, so the bound is
# reached and RSS must stop growing), SOAK_CONNECTIONS (wrk connections, default 32).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[[ $# -eq 1 && $1 =~ ^[0-9]+$ && $1 -gt 0 ]] || { echo "usage: $0 MINUTES" >&2; exit 2; }
minutes=$1
keys=${SOAK_KEYS:-1048576}
max_keys=${SOAK_MAX_KEYS:-250000}
conns=${SOAK_CONNECTIONS:-32}

for tool in redis-server redis-cli wrk h2load curl; do
  command -v "$tool" >/dev/null || { echo "soak.sh: $tool is missing" >&2; exit 3; }
done

if [[ -n ${SOAK_BIN:-} ]]; then
  bin=$SOAK_BIN
else
  echo "==> cargo build --profile dist"
  cargo build --profile dist --quiet
  bin=target/dist/tollgate
fi
bin=$(realpath "$bin")

dir=${SOAK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/tollgate-soak.XXXXXX")}
mkdir -p "$dir"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 20000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
}
wait_port() {
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "soak.sh: nothing listens on port $1 (logs in $dir)" >&2
  exit 1
}

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
  --dir "$dir" --logfile "$dir/redis.log" &
pids+=($!)
wait_port "$redis_port"
rcli() { redis-cli -p "$redis_port" "$@"; }

up_port=$(free_port)
if command -v nginx >/dev/null; then
  mkdir -p "$dir/nginx"
  cat >"$dir/nginx/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $dir/nginx/nginx.pid;
error_log $dir/nginx/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  server {
    listen 127.0.0.1:$up_port;
    location / { default_type text/plain; return 200 "ok\n"; }
  }
}
EOF
  nginx -p "$dir/nginx" -e "$dir/nginx/error.log" -c "$dir/nginx/nginx.conf" &
  pids+=($!)
  upstream="nginx"
else
  cat >"$dir/upstream.yaml" <<EOF
listen: 127.0.0.1:$up_port
upstreams:
  ok: { respond: { status: 200, body: "ok\n" } }
routes:
  - upstream: ok
EOF
  "$bin" -c "$dir/upstream.yaml" 2>"$dir/upstream.log" &
  pids+=($!)
  upstream="tollgate responder"
fi
wait_port "$up_port"

port=$(free_port)
admin=$(free_port)
cat >"$dir/tollgate.yaml" <<EOF
listen: 127.0.0.1:$port
admin: 127.0.0.1:$admin
trusted_proxies: [127.0.0.1/32, "::1/128"]
cache: { max_bytes: 16MiB, max_entry_bytes: 64KiB }
redis:
  url: redis://127.0.0.1:$redis_port
  timeout: 50ms
  on_error: local
upstreams:
  up: { url: "http://127.0.0.1:$up_port" }
routes:
  - name: local
    match: { path_prefix: /local/ }
    upstream: up
    on_limit: { stale: { max_age: 1m } }
    limits:
      - { name: tb, algorithm: token_bucket, rate: 1/m, burst: 5, key: client_ip, max_keys: $max_keys }
      - { name: sw, algorithm: sliding_window, rate: 20/m, key: client_ip, max_keys: $max_keys }
      - { name: lb, algorithm: leaky_bucket, rate: 1/s, max_delay: 2s, key: client_ip, max_keys: $max_keys }
  - name: redis
    match: { path_prefix: /redis/ }
    upstream: up
    limits:
      - { name: tb, algorithm: token_bucket, rate: 1/m, burst: 5, key: client_ip, store: redis, max_keys: $max_keys }
      - { name: fw, algorithm: fixed_window, rate: 20/m, key: client_ip, store: redis, max_keys: $max_keys }
      - { name: sw, algorithm: sliding_window, rate: 20/m, key: client_ip, store: redis, max_keys: $max_keys }
      - { name: sl, algorithm: sliding_log, rate: 10/m, key: client_ip, store: redis, max_keys: $max_keys }
      - { name: lb, algorithm: leaky_bucket, rate: 1/s, key: client_ip, store: redis, max_keys: $max_keys }
  - name: leased
    match: { path_prefix: /leased/ }
    upstream: up
    limits:
      - { name: tb, algorithm: token_bucket, rate: 1/m, burst: 20, key: client_ip, store: redis, lease: 5, max_keys: $max_keys }
  - name: hot
    match: { path_prefix: /hot/ }
    upstream: up
    limits:
      - { name: all, algorithm: token_bucket, rate: 500/s, burst: 100, key: route }
  - name: other
    upstream: up
EOF
"$bin" -c "$dir/tollgate.yaml" check >/dev/null
"$bin" -c "$dir/tollgate.yaml" 2>"$dir/tollgate.log" &
tollgate_pid=$!
pids+=("$tollgate_pid")
wait_port "$port"

# One request: a random client of $keys addresses, a random room; /local/ URLs churn the cache.
cat >"$dir/soak.lua" <<'EOF'
local keys = tonumber(os.getenv("SOAK_KEYS"))
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  math.randomseed(os.time() * 1000 + math.floor(os.clock() * 1e6))
  statuses = {}
end
local rooms = { "/local/item?id=", "/redis/item?id=", "/leased/item?id=", "/hot/item?id=", "/other?id=" }
function request()
  local i = math.random(0, keys - 1)
  local ip = string.format("100.%d.%d.%d", 64 + math.floor(i / 65536) % 64, math.floor(i / 256) % 256, i % 256)
  local path = rooms[math.random(#rooms)] .. math.random(0, 99999)
  return wrk.format("GET", path, { ["X-Forwarded-For"] = ip .. ", 127.0.0.1" })
end
function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
function done(summary, latency, requests)
  local all = {}
  for _, t in ipairs(threads) do
    for status, n in pairs(t:get("statuses")) do all[status] = (all[status] or 0) + n end
  end
  local ok, limited, bad = 0, 0, 0
  for status, n in pairs(all) do
    if status >= 200 and status < 300 then ok = ok + n
    elseif status == 429 then limited = limited + n
    else bad = bad + n end
  end
  local e = summary.errors
  local socket = e.connect + e.read + e.write + e.timeout
  io.write(string.format("SOAK requests=%d ok=%d limited=%d bad_status=%d socket_errors=%d\n",
    summary.requests, ok, limited, bad, socket))
end
EOF
printf 'http://127.0.0.1:%s/hot/h2\nhttp://127.0.0.1:%s/local/h2\nhttp://127.0.0.1:%s/redis/h2\n' \
  "$port" "$port" "$port" >"$dir/h2.urls"

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$tollgate_pid/status" 2>/dev/null || echo 0; }
metric_sum() {
  curl -s "http://127.0.0.1:$admin/metrics" | awk -v m="$1" '$1 ~ "^"m"({|$)" { s += $2 } END { printf "%d", s }'
}
keyspace() { rcli INFO keyspace | awk -F'[=,:]' '/^db0:/ { print $3, $5 }'; }

echo "==> soak: ${minutes} min, $keys client addresses, max_keys $max_keys, upstream $upstream, work dir $dir"
printf '%6s %9s %10s %10s %7s %9s %8s %8s %7s %7s\n' \
  time rss_MiB local_keys redis_keys no_ttl requests ok_2xx 429 failed rps
slices=$((minutes * 2))
rss=()
total_failed=0 total_requests=0 total_no_ttl=0
for ((s = 1; s <= slices; s++)); do
  SOAK_KEYS=$keys wrk -t1 -c"$conns" -d30s --timeout 5s -s "$dir/soak.lua" "http://127.0.0.1:$port" \
    >"$dir/wrk.out" 2>&1 &
  wrk_pid=$!
  h2load -c2 -m4 --rps=1000 -D 30 --warm-up-time=0 -H 'x-forwarded-for: 100.127.0.1' -i "$dir/h2.urls" \
    >"$dir/h2load.out" 2>&1 &
  h2_pid=$!
  wait "$wrk_pid" || true
  wait "$h2_pid" || true
  read -r requests ok limited bad socket < <(sed -n 's/^SOAK requests=\([0-9]*\) ok=\([0-9]*\) limited=\([0-9]*\) bad_status=\([0-9]*\) socket_errors=\([0-9]*\)/\1 \2 \3 \4 \5/p' "$dir/wrk.out")
  [[ -n ${requests:-} ]] || { cat "$dir/wrk.out"; echo "soak.sh: wrk gave no summary" >&2; exit 1; }
  # h2load: "requests: T total, S started, D done, ..." and "status codes: a 2xx, b 3xx, c 4xx,
  # d 5xx". Its 4xx are 429s (one client address on limited routes); a done request without a
  # 2xx or 4xx (a 5xx, a reset stream, a broken connection) failed.
  read -r h2_done < <(awk '/^requests:/ { print $6 }' "$dir/h2load.out")
  read -r h2_2xx h2_4xx < <(awk '/^status codes:/ { print $3, $7 }' "$dir/h2load.out")
  h2_done=${h2_done:-0} h2_2xx=${h2_2xx:-0} h2_4xx=${h2_4xx:-0}
  h2_bad=$((h2_done - h2_2xx - h2_4xx))
  ((h2_done > 0)) || { cat "$dir/h2load.out"; echo "soak.sh: h2load made no request" >&2; exit 1; }
  failed=$((bad + socket + h2_bad))
  read -r rkeys rexpires < <(keyspace)
  rkeys=${rkeys:-0} rexpires=${rexpires:-0}
  no_ttl=$((rkeys - rexpires))
  r=$(rss_kib)
  rss+=("$r")
  total_failed=$((total_failed + failed))
  total_requests=$((total_requests + requests + h2_done))
  ((no_ttl > total_no_ttl)) && total_no_ttl=$no_ttl
  printf '%5ds %9d %10s %10d %7d %9d %8d %8d %7d %7d\n' $((s * 30)) $((r / 1024)) \
    "$(metric_sum tollgate_local_store_keys)" "$rkeys" "$no_ttl" $((requests + h2_done)) \
    $((ok + h2_2xx)) $((limited + h2_4xx)) "$failed" $(((requests + h2_done) / 30))
  if ! kill -0 "$tollgate_pid" 2>/dev/null; then
    echo "soak.sh: tollgate exited (log: $dir/tollgate.log)" >&2
    exit 1
  fi
done

# Every key of a sample (up to 20000) has a TTL: PTTL -1 means none.
{ rcli --scan || true; } | head -n 20000 >"$dir/keys.sample" || true
sampled=$(wc -l <"$dir/keys.sample")
sample_no_ttl=$(awk '{ print "PTTL", $0 }' "$dir/keys.sample" | rcli | grep -c '^-1$' || true)

half=${rss[$(((${#rss[@]} - 1) / 2))]}
last=${rss[-1]}
limit=$((half + half / 10 + 16 * 1024))
echo "==> summary after ${minutes} min: $total_requests requests"
verdict=0
if ((${#rss[@]} < 4)); then
  echo "    RSS plateau:        n/a (run at least 2 minutes): $((last / 1024)) MiB at the end"
elif ((last <= limit)); then
  echo "    RSS plateau:        PASS ($((half / 1024)) MiB at half time, $((last / 1024)) MiB at the end, bound $((limit / 1024)) MiB)"
else
  echo "    RSS plateau:        FAIL ($((half / 1024)) MiB at half time, $((last / 1024)) MiB at the end, bound $((limit / 1024)) MiB)"
  verdict=1
fi
if ((total_no_ttl == 0 && sample_no_ttl == 0)); then
  echo "    Redis keys w/o TTL: PASS (0 in every INFO keyspace; 0 of $sampled scanned keys)"
else
  echo "    Redis keys w/o TTL: FAIL (up to $total_no_ttl in INFO keyspace; $sample_no_ttl of $sampled scanned keys)"
  verdict=1
fi
if ((total_failed == 0)); then
  echo "    failed requests:    PASS (0)"
else
  echo "    failed requests:    FAIL ($total_failed; last slice: $dir/wrk.out, $dir/h2load.out)"
  verdict=1
fi
exit "$verdict"
