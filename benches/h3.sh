#!/usr/bin/env bash
# HTTP/3 termination, tollgate beside Caddy in the same run (issue 38):
#
#   benches/h3.sh target/dist/tollgate        # ROUNDS=3 N=20000 HANDSHAKES=1000 BASE_PORT=18600 H3LOAD=
#
# Both terminate HTTP/3 (QUIC, TLS 1.3, one ECDSA P-256 certificate from a CA made here by
# openssl) and proxy to the same nginx upstream (`return 200`) over keep-alive HTTP/1.1:
# Caddy's `reverse_proxy` with `protocols h1 h2 h3`, tollgate with `http3: true` and one
# worker. Both are pinned to core 0, the load generator to core 1. Debian's h2load has no
# QUIC, so the load comes from examples/h3load.rs (quinn and the h3 crate), built here.
#
# 1. requests: 10 connections with 10 streams each in flight, N GETs; CPU per request
#    (utime + stime of the server process, from /proc) and requests/s.
# 2. handshakes: HANDSHAKES connections of one GET each (no resumption), 10 at a time; CPU
#    per handshake (the GET included) and handshakes/s.
#
# Rounds alternate the servers. On a shared machine the absolute numbers are noisy: read the
# ratios within a round.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 TOLLGATE_BINARY" >&2; exit 2; }
bin=$(realpath "$1")
for t in nginx caddy openssl taskset; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
rounds=${ROUNDS:-3} n=${N:-20000} handshakes=${HANDSHAKES:-1000} bp=${BASE_PORT:-18600}
# H3LOAD: a load generator built before (`cargo build --profile dist --example h3load`).
load=${H3LOAD:-}
if [[ -z $load ]]; then
  cargo build --profile dist --quiet --example h3load
  load=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/examples/h3load
fi
load=$(realpath "$load")
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_upstream "$work" "$bp" 0

cd "$work"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
  -addext basicConstraints=critical,CA:TRUE -keyout ca.key -out ca.pem 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=bench.test -keyout key.pem -out req.csr 2>/dev/null
printf 'subjectAltName=DNS:bench.test\n' > ext.cnf
openssl x509 -req -in req.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile ext.cnf -out cert.pem 2>/dev/null

cat > Caddyfile <<CADDY
{
  admin off
  auto_https disable_redirects
  servers {
    protocols h1 h2 h3
  }
  log {
    output discard
  }
}
https://bench.test:$((bp + 1)) {
  bind 127.0.0.1
  tls $work/cert.pem $work/key.pem
  reverse_proxy 127.0.0.1:$bp
}
CADDY
cat > tollgate.yaml <<YAML
listen:
  - addr: 127.0.0.1:$((bp + 2))
    tls: { certificates: [{ cert: cert.pem, key: key.pem }] }
    http3: true
    quic: { retry_above: 1000000, new_connections_per_ip: 1000000 }   # Caddy has neither
server: { workers: 1 }
upstreams: { up: { url: 'http://127.0.0.1:$bp' } }
routes: [{ upstream: up }]
YAML
XDG_DATA_HOME=$work XDG_CONFIG_HOME=$work taskset -c 0 caddy run --config Caddyfile --adapter caddyfile 2>caddy.log &
echo $! > caddy.pid
taskset -c 0 "$bin" -c tollgate.yaml 2>tollgate.log &
echo $! > tollgate.pid
declare -A pids=([caddy]=$(cat caddy.pid) [tollgate]=$(cat tollgate.pid)) ports=([caddy]=$((bp + 1)) [tollgate]=$((bp + 2)))
for who in caddy tollgate; do
  up=
  for _ in $(seq 20); do
    kill -0 "${pids[$who]}" 2>/dev/null || break
    timeout 3 taskset -c 1 "$load" "127.0.0.1:${ports[$who]}" bench.test ca.pem / 1 1 1 2>/dev/null | grep -q 'requests 1 ' && { up=1; break; }
    sleep 0.2
  done
  [[ -n $up ]] || { echo "$who did not answer over HTTP/3:" >&2; tail -5 "$who.log" >&2; exit 1; }
done
hz=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
per() { awk -v t="$1" -v n="$2" -v hz="$hz" 'BEGIN{printf "%.1f", t * 1e6 / hz / n}'; }

for r in $(seq "$rounds"); do
  for who in caddy tollgate; do
    addr=127.0.0.1:${ports[$who]} pid=${pids[$who]}
    taskset -c 1 "$load" "$addr" bench.test ca.pem / 2000 10 10 >/dev/null
    c0=$(cpu "$pid"); out=$(taskset -c 1 "$load" "$addr" bench.test ca.pem / "$n" 10 10); c1=$(cpu "$pid")
    printf 'round %d  %-9s requests    %8s req/s  %6s us CPU/request    (%s)\n' "$r" "$who" \
      "$(awk '{print $8}' <<<"$out")" "$(per $((c1 - c0)) "$n")" "$out"
    c0=$(cpu "$pid"); out=$(taskset -c 1 "$load" "$addr" bench.test ca.pem / "$handshakes" 10 1 --handshakes); c1=$(cpu "$pid")
    printf 'round %d  %-9s handshakes  %8s hs/s   %6s us CPU/handshake  (%s)\n' "$r" "$who" \
      "$(awk '{print $8}' <<<"$out")" "$(per $((c1 - c0)) "$handshakes")" "$out"
  done
done
