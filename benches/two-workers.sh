#!/usr/bin/env bash
# tollgate's default shape (`tollgate run`: `server.workers: auto`, one single-threaded worker
# per core accepting from one shared listener) against nginx with `worker_processes 2`, both proxying to one nginx upstream
# (`return 200`) with a per-client-IP limit on the path that never rejects. Nothing is pinned:
# the proxies, the upstream and wrk (-t2 -c100) share both cores, so the figures are NOISY and
# only say how the two shapes compare on this machine, not what either costs.
#
#   benches/two-workers.sh target/dist/tollgate            # ROUNDS=3 DURATION=10s
#   benches/two-workers.sh /tmp/old/tollgate target/dist/tollgate   # interleaved, each round
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 TOLLGATE_BINARY..." >&2; exit 2; }
for t in nginx wrk; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
rounds=${ROUNDS:-3} duration=${DURATION:-10s}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_upstream "$work" 18490
mkdir -p "$work/ngx"
cat > "$work/ngx/nginx.conf" <<NGX
worker_processes 2; daemon on; pid $work/ngx.pid; error_log $work/ngx/error.log crit;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000000;
  upstream up { server 127.0.0.1:18490; keepalive 1024; }
  limit_req_zone \$binary_remote_addr zone=z:10m rate=100000000r/s;
  server { listen 127.0.0.1:18491; location / { limit_req zone=z burst=100000000 nodelay;
    proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
NGX
nginx -c "$work/ngx/nginx.conf" -p "$work/ngx"
bins=("$@")
for i in "${!bins[@]}"; do
  port=$((18492 + i))
  cat > "$work/tollgate$i.yaml" <<YAML
listen: 127.0.0.1:$port
upstreams: { up: { url: http://127.0.0.1:18490 } }
routes:
  - name: bench
    upstream: up
    limits: [{ name: per-client, algorithm: token_bucket, rate: 1000000/s, burst: 100000000, key: client_ip }]
YAML
  "${bins[$i]}" run -c "$work/tollgate$i.yaml" 2>"$work/tollgate$i.log" & echo $! > "$work/tollgate$i.pid"
  for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
done
cpu() { local t=0; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
hz=$(getconf CLK_TCK)
ngx_pids=$(pgrep -P "$(cat "$work/ngx.pid")" | tr '\n' ' ')
printf '%-9s %5s %10s %12s\n' proxy round req/s 'cpu us/req'
for r in $(seq "$rounds"); do
  for who in nginx "${!bins[@]}"; do
    if [[ $who == nginx ]]; then port=18491 pids=$ngx_pids; else port=$((18492 + who)) pids=$(cat "$work/tollgate$who.pid"); who="tollgate$who"; fi
    # shellcheck disable=SC2086
    before=$(cpu $pids)
    out=$(wrk -t2 -c100 -d"$duration" "http://127.0.0.1:$port/")
    # shellcheck disable=SC2086
    after=$(cpu $pids)
    rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
    reqs=$(awk '/requests in/{print $1}' <<<"$out")
    printf '%-9s %5s %10.0f %12.1f\n' "$who" "$r" "$rps" "$(awk -v c=$((after - before)) -v n="$reqs" -v hz="$hz" 'BEGIN{print c / hz * 1e6 / n}')"
  done
done
