#!/usr/bin/env bash
# Memory per idle connection (issue 23): tollgate, nginx and HAProxy configured alike (one
# built-in responder route answering `200 ok`, a per-client-IP limit that never rejects,
# keep-alive and idle timeouts of 600 s), each holding N idle keep-alive connections that
# have each made one request, over HTTP/1.1 and over h2c (prior knowledge).
#
#   benches/conns.sh [N]                       # N=10000; TOLLGATE=target/dist/tollgate; WORKERS=auto
#                                              # PORT=18590 (nginx and HAProxy serve h2c on PORT+1)
#   SERVERS="tollgate" PROTOS=h1 benches/conns.sh 19000
#
# For each server and protocol it prints:
#   - bytes/conn: (RSS holding N idle connections - RSS before them) / N, the serving
#     process's RSS (nginx: its one worker; tollgate: `tollgate run`, one process);
#   - p99 ms: a separate client's latency (wrk, 1 connection, PROBE seconds) while the N
#     are held: NOISY on a shared machine;
#   - RSS before, holding, and SETTLE (30) seconds after all N closed, and that last one
#     against the one before as a percentage.
# The fd limit is raised as far as the hard limit allows (and printed); N larger than what
# one client process may open is spread over several client processes, and client sockets
# over several 127.0.0.x source addresses. Requires python3, nginx, haproxy, wrk, curl.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
n=${1:-10000}
tollgate=${TOLLGATE:-$here/../target/dist/tollgate}
servers=${SERVERS:-tollgate nginx haproxy}
protos=${PROTOS:-h1 h2}
settle=${SETTLE:-30} probe=${PROBE:-5}
for t in python3 curl wrk; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
limit=$(ulimit -n)
echo "# fd limit: $limit (hard limit $(ulimit -Hn)); N=$n idle connections per run"
per_client=$((limit - 200))
if ((n + 100 > limit)); then
  echo "# note: N + 100 > the fd limit: a server cannot hold N connections here" >&2
fi
work=$(mktemp -d /tmp/conns.XXXXXX)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
port=${PORT:-18590} wconn=$((n + 500))
h2port=$((port + 1))

rss_kb() { awk '/^VmRSS:/{print $2}' "/proc/$1/status"; }

start_nginx() {
  mkdir -p "$work/ngx"
  cat > "$work/ngx/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/nginx.pid; error_log $work/ngx/error.log crit;
worker_rlimit_nofile $limit;
events { worker_connections $wconn; }
http { access_log off; keepalive_timeout 600s; keepalive_requests 1000000000;
  limit_req_zone \$binary_remote_addr zone=z:10m rate=100000000r/s;
  server { listen 127.0.0.1:$port; listen 127.0.0.1:$h2port http2;
    location / { limit_req zone=z burst=100000000 nodelay; return 200 "ok\n"; } } }
NGX
  nginx -c "$work/ngx/nginx.conf" -p "$work/ngx" >/dev/null 2>&1
  sleep 0.5
  pgrep -P "$(cat "$work/nginx.pid")" | head -1
}

start_haproxy() {
  cat > "$work/haproxy.cfg" <<HAP
global
  maxconn $wconn
  # maxsock would be 2 × maxconn: past the fd limit, so start anyway (nothing is proxied here).
  no strict-limits
  nbthread 1
  pidfile $work/haproxy.pid
defaults
  mode http
  timeout client 600s
  timeout http-keep-alive 600s
  timeout http-request 600s
  timeout connect 5s
  timeout server 5s
frontend h1
  bind 127.0.0.1:$port
  stick-table type ip size 100k expire 60s store http_req_rate(1s)
  http-request track-sc0 src
  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }
  http-request return status 200 content-type text/plain string "ok"
frontend h2
  bind 127.0.0.1:$h2port proto h2
  stick-table type ip size 100k expire 60s store http_req_rate(1s)
  http-request track-sc0 src
  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }
  http-request return status 200 content-type text/plain string "ok"
HAP
  haproxy -D -f "$work/haproxy.cfg" >/dev/null 2>"$work/haproxy.log"
  for _ in $(seq 50); do [[ -s $work/haproxy.pid ]] && break; sleep 0.1; done
  cat "$work/haproxy.pid"
}

start_tollgate() {
  cat > "$work/tollgate.yaml" <<YAML
listen: 127.0.0.1:$port
server:
  keepalive_timeout: 600s
  header_read_timeout: 600s
  max_connections: $wconn
  workers: ${WORKERS:-auto}
  h2: { idle_timeout: 600s, ping_interval: 600s }
upstreams:
  ok: { respond: { status: 200, headers: { content-type: text/plain }, body: "ok\n" } }
routes:
  - name: all
    upstream: ok
    limits: [{ name: per-client, algorithm: token_bucket, rate: 1000000/s, burst: 100000000, key: client_ip }]
YAML
  "$tollgate" run -c "$work/tollgate.yaml" >/dev/null 2>"$work/tollgate.log" & echo $! > "$work/tollgate.pid"
  cat "$work/tollgate.pid"
}

stop_server() {
  kill "$(cat "$work/$1.pid" 2>/dev/null)" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$(cat "$work/$1.pid" 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
  rm -f "$work/$1.pid"
}

printf '%-9s %-5s %11s %8s %12s %12s %12s %8s  %s\n' server proto bytes/conn 'p99 ms' 'RSS before' 'RSS held' "RSS +${settle}s" 'after/' 'clients'
for server in $servers; do
  for proto in $protos; do
    p=$port
    [[ $proto == h2 && $server != tollgate ]] && p=$h2port
    pid=$("start_$server")
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
    # Warm: what the first requests allocate once is not per connection. wrk speaks HTTP/1.1
    # only: before h2c, 20 h2c connections make a request each and close, so the h2 code's
    # first use (its pages of machine code, what it builds once) is not counted as kept
    # after the N are gone.
    wrk -t1 -c20 -d1s "http://127.0.0.1:$port/" >/dev/null 2>&1 || true
    if [[ $proto == h2 ]]; then
      mkfifo "$work/warm"
      python3 "$here/conns_client.py" 127.0.0.1 "$p" 20 h2 1 <"$work/warm" >"$work/warm.out" 2>/dev/null &
      warm=$!
      exec {warm_in}>"$work/warm"
      for _ in $(seq 100); do grep -q '^ready' "$work/warm.out" 2>/dev/null && break; sleep 0.1; done
      exec {warm_in}>&-
      wait "$warm" || true
      rm -f "$work/warm" "$work/warm.out"
    fi
    sleep 1
    before=$(rss_kb "$pid")
    clients=0 left=$n
    : > "$work/client.log"
    while ((left > 0)); do
      k=$((left < per_client ? left : per_client))
      mkfifo "$work/in.$clients"
      python3 "$here/conns_client.py" 127.0.0.1 "$p" "$k" "$proto" 8 <"$work/in.$clients" >"$work/out.$clients" 2>>"$work/client.log" &
      echo $! > "$work/client$clients.pid"
      # Hold the fifo open: the client holds its connections until this end closes.
      eval "exec {hold_$clients}>\"$work/in.$clients\""
      left=$((left - k)) clients=$((clients + 1))
    done
    ok=0 failed=0
    for ((c = 0; c < clients; c++)); do
      until grep -q '^ready' "$work/out.$c" 2>/dev/null; do sleep 0.5; done
      read -r _ o f < "$work/out.$c"
      ok=$((ok + ${o#ok=})) failed=$((failed + ${f#failed=}))
    done
    # Let idle-time housekeeping (tollgate parks an idle HTTP/1 connection) run first.
    sleep 3
    held=$(rss_kb "$pid")
    p99=$(wrk -t1 -c1 -d"${probe}s" --latency "http://127.0.0.1:$port/" 2>/dev/null | awk '/^ +99%/{v=$2; if (v ~ /us$/) {sub(/us/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1000}; print v}')
    for ((c = 0; c < clients; c++)); do
      eval "exec {hold_$c}>&-"
    done
    lost=0
    for ((c = 0; c < clients; c++)); do
      wait "$(cat "$work/client$c.pid")" || true
      l=$(awk '/^closed/{sub(/lost=/,"",$2); print $2}' "$work/out.$c")
      lost=$((lost + ${l:-0}))
      rm -f "$work/in.$c" "$work/out.$c" "$work/client$c.pid"
    done
    sleep "$settle"
    after=$(rss_kb "$pid")
    per=$(awk -v a="$held" -v b="$before" -v n="$ok" 'BEGIN{ if (n > 0) printf "%.0f", (a - b) * 1024 / n; else print "-" }')
    pct=$(awk -v a="$after" -v b="$before" 'BEGIN{printf "%.0f%%", a * 100 / b}')
    printf '%-9s %-5s %11s %8s %9s kB %9s kB %9s kB %8s  ok=%s failed=%s lost=%s\n' "$server" "$proto" "$per" "${p99:--}" "$before" "$held" "$after" "$pct" "$ok" "$failed" "$lost"
    stop_server "$server"
  done
done
