#!/usr/bin/env bash
# Load comparison: tollgate vs nginx (and HAProxy) on this machine, same upstream, same run.
#
#   benches/load.sh                      # all scenarios through benches/harness/run.sh
#   SCENARIOS=pass ROUNDS=5 benches/load.sh
#
# It builds tollgate with the dist profile (benchmarks/profiles.md) and hands it to the shared harness as the candidate
# (`tollgate bench`: one worker thread, pass / reject / h2c ports from the environment). The
# harness pins cores, interleaves rounds, reports CPU per request (`srv us/req`) and req/s
# ratios against nginx, and flags disturbed runs; see benchmarks/harness.md. It needs nginx,
# HAProxy, wrk and h2load (benchmarks/README.md, "What the scripts need"); without HAProxy a
# minimal nginx-vs-tollgate pass comparison with wrk runs instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
cargo build --profile dist --quiet
bin=$root/target/dist/tollgate

harness=$root/benches/harness/run.sh
if command -v haproxy >/dev/null && command -v h2load >/dev/null; then
  export CANDIDATE_NAME=${CANDIDATE_NAME:-tollgate}
  export CANDIDATE_PORT=${CANDIDATE_PORT:-18020}
  export CANDIDATE_REJECT_PORT=${CANDIDATE_REJECT_PORT:-18021}
  export CANDIDATE_H2_PORT=${CANDIDATE_H2_PORT:-18022}
  export CANDIDATE_CMD="$bin bench"
  exec bash "$harness"
fi

# ---- fallback: nginx upstream, nginx proxy, tollgate; wrk -t1 -c50 on the other core ----
for t in nginx wrk taskset; do command -v $t >/dev/null || { echo "missing $t (apt-get install nginx wrk util-linux)"; exit 1; }; done
work=$(mktemp -d); trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null; rm -rf "$work"' EXIT
cat > "$work/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/nginx.pid; error_log $work/error.log crit;
events { worker_connections 4096; }
http {
  access_log off; keepalive_requests 1000000000;
  upstream up { server 127.0.0.1:18100; keepalive 1024; }
  limit_req_zone \$binary_remote_addr zone=z:10m rate=100000000r/s;
  server { listen 127.0.0.1:18100; location / { return 200 "ok\n"; } }
  server { listen 127.0.0.1:18101; location / { limit_req zone=z burst=100000000 nodelay;
    proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; } }
}
NGX
taskset -c 0 nginx -c "$work/nginx.conf" -p "$work"
UPSTREAM_ADDR=127.0.0.1:18100 LISTEN_ADDR=127.0.0.1:18102 taskset -c 0 "$bin" bench & echo $! > "$work/tollgate.pid"
sleep 1
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }
run() { # name port pid
  local before after out
  before=$(cpu "$3"); out=$(taskset -c 1 wrk -t1 -c50 -d10s "http://127.0.0.1:$2/"); after=$(cpu "$3")
  local rps reqs; rps=$(awk '/Requests\/sec/{print $2}' <<<"$out"); reqs=$(awk '/requests in/{print $1}' <<<"$out")
  echo "$1 $rps $(awk -v t=$((after-before)) -v n="$reqs" 'BEGIN{printf "%.1f", t*10000/n}')"
}
nginx_worker=$(pgrep -P "$(cat "$work/nginx.pid")" | head -1)
printf '%-10s %12s %12s\n' target req/s 'srv us/req'
a=$(run nginx 18101 "$nginx_worker"); b=$(run tollgate 18102 "$(cat "$work/tollgate.pid")")
printf '%-10s %12s %12s\n' $a; printf '%-10s %12s %12s\n' $b
awk -v a="$a" -v b="$b" 'BEGIN{split(a,x," "); split(b,y," "); printf "tollgate/nginx: req/s %.2f, cpu/req %.2f (nginx worker CPU includes the upstream server block)\n", y[2]/x[2], y[3]/x[3]}'
