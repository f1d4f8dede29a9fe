#!/usr/bin/env bash
# User-space instructions per request of HTTP/2 to an HTTP/2 upstream (callgrind, as
# benches/instr.sh counts the other paths): `tollgate run` with one `protocol: h2c` upstream,
# nginx `listen … http2` (`return 200 "ok\n"`) behind it, h2load -m 10 over 50 connections
# (2,000 warm-up requests, then N counted). TLS=1: the upstream is HTTP/2 over TLS (nginx
# `ssl http2`, an ECDSA certificate of a CA made here; tollgate `protocol: h2` with `ca_file`).
#
#   benches/instr-h2-upstream.sh OLD NEW OLD NEW          # N=10000 BASE_PORT=18790
#   TLS=1 benches/instr-h2-upstream.sh target/dist/tollgate
#
# KEEP=dir keeps each profile for callgrind_annotate.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 BINARY..." >&2; exit 2; }
for t in nginx h2load valgrind callgrind_control openssl curl; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
n=${N:-10000} bp=${BASE_PORT:-18790}
up=$bp tg=$((bp + 1))
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_h2_upstream "$work" "$up"
cat > "$work/tollgate.yaml" <<YAML
listen: 127.0.0.1:$tg
upstreams:
  up: { url: '$url', protocol: $proto }
routes:
  - { name: all, upstream: up }
YAML
for bin in "$@"; do
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.out" "$bin" run -c "$work/tollgate.yaml" \
    2>"$work/vg.log" &
  for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$tg/" && break; sleep 0.2; done
  pgrep -f "valgrind.bin.*$work/cg.out" > "$work/tg.pid"
  h2load -m 10 -n 2000 -c 50 "http://127.0.0.1:$tg/" >/dev/null
  callgrind_control -i on "$(cat "$work/tg.pid")" >/dev/null 2>&1
  h2load -m 10 -n "$n" -c 50 "http://127.0.0.1:$tg/" | grep -E "^status codes" || true
  callgrind_control -d "$(cat "$work/tg.pid")" >/dev/null 2>&1
  kill "$(cat "$work/tg.pid")"; wait 2>/dev/null || true; rm "$work/tg.pid"
  ir=$(cat "$work"/cg.out.* | awk '/^summary:/{s+=$2} END{print s}')
  printf '%-50s %10.0f instructions/request\n' "$bin" "$(awk -v i="$ir" -v n="$n" 'BEGIN{print i/n}')"
  if [[ -n ${KEEP:-} ]]; then cat "$work"/cg.out.* > "$KEEP/$(basename "$bin").callgrind"; fi
  rm -f "$work"/cg.out*
done
