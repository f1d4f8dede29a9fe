#!/usr/bin/env bash
# TLS termination, tollgate against nginx in the same run (issue 16):
#
#   benches/tls.sh target/dist/tollgate        # ROUNDS=3 N=20000 HANDSHAKES=2000
#   LABELS="ring aws-lc" benches/tls.sh A B        # several builds (the `aws-lc-rs` feature's) in one run
#
# Both terminate TLS 1.3 with one ECDSA P-256 certificate (generated here by openssl) and
# proxy to the same nginx upstream (`return 200`) over plain keep-alive HTTP/1.1; nginx runs
# one worker, tollgate `bench` mode (one worker thread), both pinned to core 0, the load
# generator (h2load) to core 1.
#
# 1. keep-alive pass-through: h2load --h1, 50 connections, N requests over TLS; CPU per
#    request (utime + stime of the server process, from /proc) and requests/s.
# 2. full handshakes: HANDSHAKES connections of one request each (h2load resumes no sessions),
#    in batches of 100; CPU per handshake and handshakes/s.
#
# Rounds alternate the servers: nginx, then each tollgate binary given (on its own port, named
# by LABELS). Without the quiet gate of benches/harness/run.sh the absolute numbers are noisy
# on a shared machine: compare the servers within a round.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 TOLLGATE_BINARY [MORE_TOLLGATE_BINARIES...]" >&2; exit 2; }
bins=("$@")
read -r -a labels <<<"${LABELS:-tollgate tollgate-b}"
for t in nginx h2load openssl taskset; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
rounds=${ROUNDS:-3} n=${N:-20000} handshakes=${HANDSHAKES:-2000}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_upstream "$work" 18390 0

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench.test \
  -addext subjectAltName=DNS:bench.test -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null

mkdir -p "$work/front"
cat > "$work/front/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/front.pid; error_log $work/front/error.log crit;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000000;
  upstream up { server 127.0.0.1:18390; keepalive 64; }
  server { listen 127.0.0.1:18391 ssl; ssl_certificate $work/cert.pem; ssl_certificate_key $work/key.pem;
    ssl_protocols TLSv1.3; ssl_session_tickets off; ssl_session_cache off;
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
NGX
taskset -c 0 nginx -c "$work/front/nginx.conf" -p "$work/front"
# nginx's worker is the child of its master.
declare -A pids=([nginx]=$(pgrep -P "$(cat "$work/front.pid")")) ports=([nginx]=18391)
servers=(nginx)
for i in "${!bins[@]}"; do
  who=${labels[$i]:-tollgate-$i} port=$((18392 + i))
  UPSTREAM_ADDR=127.0.0.1:18390 LISTEN_ADDR=127.0.0.1:$port BENCH_TLS_CERT="$work/cert.pem" \
    BENCH_TLS_KEY="$work/key.pem" taskset -c 0 "${bins[$i]}" bench 2>"$work/$who.log" &
  echo $! > "$work/$who.pid"
  for _ in $(seq 50); do curl -sk -o /dev/null "https://127.0.0.1:$port/" && break; sleep 0.2; done
  pids[$who]=$(cat "$work/$who.pid") ports[$who]=$port servers+=("$who")
done
hz=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
per() { awk -v t="$1" -v n="$2" -v hz="$hz" 'BEGIN{printf "%.1f", t * 1e6 / hz / n}'; }

for r in $(seq "$rounds"); do
  for who in "${servers[@]}"; do
    url=https://127.0.0.1:${ports[$who]}/ pid=${pids[$who]}
    taskset -c 1 h2load --h1 -n 2000 -c 50 "$url" >/dev/null
    c0=$(cpu "$pid"); out=$(taskset -c 1 h2load --h1 -n "$n" -c 50 "$url"); c1=$(cpu "$pid")
    rps=$(awk '/^finished in/{gsub(",", ""); print $4}' <<<"$out")
    printf 'round %d  %-9s keep-alive  %10s req/s  %6s us CPU/request  (%s)\n' "$r" "$who" "$rps" \
      "$(per $((c1 - c0)) "$n")" "$(grep -E '^status codes' <<<"$out" | tr -s ' ')"
    c0=$(cpu "$pid") t0=$(date +%s.%N)
    for _ in $(seq $((handshakes / 100))); do taskset -c 1 h2load --h1 -n 100 -c 100 "$url" >/dev/null; done
    c1=$(cpu "$pid") t1=$(date +%s.%N)
    printf 'round %d  %-9s handshakes  %10.0f hs/s   %6s us CPU/handshake\n' "$r" "$who" \
      "$(awk -v n="$handshakes" -v a="$t0" -v b="$t1" 'BEGIN{print n / (b - a)}')" "$(per $((c1 - c0)) "$handshakes")"
  done
done
