#!/usr/bin/env bash
# HTTP/2 pass-through to an h2c upstream: tollgate (`protocol: h2c`) against HAProxy
# (`proto h2` backend), both behind the same nginx h2c upstream, h2load -m 10 as the client.
# CPU per request of the proxy process from /proc (utime + stime), user-space part beside it.
# TLS=1: the upstream is HTTP/2 over TLS instead (nginx `ssl http2`, a self-signed ECDSA
# certificate made here): tollgate `protocol: h2` trusting it by `ca_file`, HAProxy
# `ssl verify required ca-file … alpn h2`. Client to proxy stays h2c.
#
#   benches/h2-upstream.sh target/dist/tollgate         # ROUNDS=3 N=200000 CONNS=50 STREAMS=10
#   TLS=1 benches/h2-upstream.sh target/dist/tollgate
#
# Proxy and upstream share core 0, h2load runs on core 1. No quiet gate: on a shared machine
# the figures are noisy; compare the two proxies within one run.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -eq 1 ]] || { echo "usage: $0 TOLLGATE_BINARY" >&2; exit 2; }
for t in nginx haproxy h2load taskset openssl; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
bin=$1 rounds=${ROUNDS:-3} n=${N:-200000} conns=${CONNS:-50} streams=${STREAMS:-10}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
up=18390 tg=18391 hp=18392
hp_server="proto h2"
start_h2_upstream "$work" "$up" 0
if [[ -n ${TLS:-} ]]; then
  hp_server="ssl verify required ca-file $work/ca.pem verifyhost upstream.bench sni str(upstream.bench) alpn h2"
fi
cat > "$work/tollgate.yaml" <<YAML
listen: 127.0.0.1:$tg
upstreams:
  up: { url: '$url', protocol: $proto }
routes:
  - { name: all, upstream: up }
YAML
taskset -c 0 "$bin" run -c "$work/tollgate.yaml" 2>"$work/tollgate.log" &
echo $! > "$work/tollgate.pid"
cat > "$work/haproxy.cfg" <<HAP
global
  nbthread 1
  pidfile $work/haproxy.pid
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend f
  bind 127.0.0.1:$hp proto h2
  default_backend b
backend b
  http-reuse always
  server s1 127.0.0.1:$up $hp_server
HAP
taskset -c 0 haproxy -D -f "$work/haproxy.cfg"
sleep 1
cpu() { awk '{print $14, $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
for r in $(seq "$rounds"); do
  for name in tollgate haproxy; do
    port=$tg; [[ $name == haproxy ]] && port=$hp
    pid=$(cat "$work/$name.pid")
    url=http://127.0.0.1:$port/
    taskset -c 1 h2load -n 20000 -c "$conns" -m "$streams" "$url" >/dev/null
    read -r u0 s0 < <(cpu "$pid")
    out=$(taskset -c 1 h2load -n "$n" -c "$conns" -m "$streams" "$url")
    read -r u1 s1 < <(cpu "$pid")
    ok=$(awk '/^status codes:/{print $3}' <<<"$out"); rps=$(awk '/^finished in/{printf "%.0f", $4}' <<<"$out")
    us=$(awk -v t=$((u1 + s1 - u0 - s0)) -v n="$n" -v hz="$hz" 'BEGIN{printf "%.2f", t * 1e6 / hz / n}')
    user=$(awk -v t=$((u1 - u0)) -v n="$n" -v hz="$hz" 'BEGIN{printf "%.2f", t * 1e6 / hz / n}')
    printf 'round %d  %-9s %8s req/s %6s us/req (user %s)  2xx %s\n' "$r" "$name" "$rps" "$us" "$user" "$ok"
  done
done
