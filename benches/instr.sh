#!/usr/bin/env bash
# User-space instructions per request of tollgate binaries in `bench` mode, counted by
# callgrind: repeatable whatever the hypervisor or the other core is doing, so a change of
# 1-2 % shows, where CPU time on this machine moves by 5-10 % between rounds. Kernel time
# (about 70 % of a proxied request) is not counted, and neither is the cost of a cache miss
# or of a large memmove (`rep movsb` is one instruction): read it beside benches/ab.sh.
#
#   benches/instr.sh /tmp/old/tollgate target/dist/tollgate      # N=20000 PATH_=/
#   PORT_VAR=REJECT_PORT benches/instr.sh target/dist/tollgate     # the 429 path
#   H2=1 benches/instr.sh target/dist/tollgate                       # h2c, 10 streams a connection
#   PORT_VAR=PLAN_PORT benches/instr.sh target/dist/tollgate       # a plan limit (tier lookup)
#   HEADER='x-api-key: bench-key' benches/instr.sh target/dist/tollgate   # pass, same request
#   TLS=1 benches/instr.sh target/dist/tollgate      # pass over TLS 1.3 (ECDSA P-256, HTTP/1.1)
#   AUTH=es256 benches/instr.sh target/dist/tollgate  # pass with `auth:` (es256, rs256, eddsa, api_key),
#                                                        # each request sending the bench's credential
#   AUTH=es256 AUTH_BAD=1 benches/instr.sh target/dist/tollgate   # a bad credential: each request
#                                                        # verified in full and refused (401)
#   AUTH=es256 AUTH_BAD=1 AUTH_FAILURES=1/h benches/instr.sh target/dist/tollgate   # the same behind
#                                                        # `auth.failures` (burst 1): every request
#                                                        # but the first refused (429) before verification
#   CONFIG=benches/responder.yaml benches/instr.sh target/dist/tollgate   # a config's first listener
#                                                        # (here the built-in responder, no upstream)
#
# Each binary runs under valgrind behind one nginx upstream (`return 200`); h2load sends
# 2,000 warm-up requests, then N counted ones over 50 keep-alive HTTP/1.1 connections.
# With TLS=1 the counted requests include the 50 connections' full handshakes (about 1.2 M
# instructions each with ring): N=20000 puts them at about 3,000 a request, the way
# benches/tls.sh's keep-alive figure carries them; the difference between two N gives a
# keep-alive request alone. KEEP=dir keeps each profile for callgrind_annotate. BASE_PORT=18290 moves the four ports used
# (upstream, pass, reject, plan) so that two runs can share the machine.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 BINARY..." >&2; exit 2; }
for t in nginx h2load valgrind callgrind_control; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
n=${N:-20000} path=${PATH_:-/} port_var=${PORT_VAR:-LISTEN_ADDR}
proto=(--h1); [[ -n ${H2:-} ]] && proto=(-m 10)
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
bp=${BASE_PORT:-18290}
start_upstream "$work" "$bp"
scheme=http tls_env=()
if [[ -n ${TLS:-} ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench.test \
    -addext subjectAltName=DNS:bench.test -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
  scheme=https tls_env=(BENCH_TLS_CERT="$work/cert.pem" BENCH_TLS_KEY="$work/key.pem")
fi
auth_env=()
if [[ -n ${AUTH:-} ]]; then
  auth_env=(BENCH_AUTH="$AUTH" BENCH_AUTH_DIR="$work/auth" BENCH_AUTH_BAD="${AUTH_BAD:-}" BENCH_AUTH_FAILURES="${AUTH_FAILURES:-}")
  if [[ $AUTH == rs256 ]]; then
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -outform DER -out "$work/rsa.der" 2>/dev/null
    auth_env+=(BENCH_AUTH_KEY="$work/rsa.der")
  fi
fi
for bin in "$@"; do
  env=(UPSTREAM_ADDR=127.0.0.1:$bp LISTEN_ADDR=127.0.0.1:$((bp + 1)) "${tls_env[@]}" "${auth_env[@]}")
  url=$scheme://127.0.0.1:$((bp + 1))$path
  # The 429 path: a limit of 1/s admits next to nothing, however slowly valgrind runs.
  if [[ $port_var == REJECT_PORT ]]; then env+=(REJECT_PORT=$((bp + 2)) REJECT_RATE=1 REJECT_BURST=1); url=http://127.0.0.1:$((bp + 2))$path; fi
  # A plan limit (tier looked up from a clients file by x-api-key), same parameters as the pass path.
  hdr=(); [[ -n ${HEADER:-} ]] && hdr=(-H "$HEADER")
  if [[ $port_var == PLAN_PORT ]]; then env+=(PLAN_PORT=$((bp + 3))); url=http://127.0.0.1:$((bp + 3))$path; hdr=(-H 'x-api-key: bench-key'); fi
  # CONFIG=file: the binary serves that config (its first listener moved to the pass port)
  # instead of `bench`, e.g. a route of the built-in responder.
  run=(bench); [[ -n ${CONFIG:-} ]] && run=(-c "$CONFIG" --listen "127.0.0.1:$((bp + 1))")
  env "${env[@]}" valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.out" "$bin" "${run[@]}" \
    2>"$work/vg.log" &
  for _ in $(seq 100); do curl -sk -o /dev/null "$url" && break; sleep 0.2; done
  # The bench wrote the credential its route takes (a fresh key per run).
  if [[ -n ${AUTH:-} ]]; then hdr=(-H "$(cat "$work/auth/credential")"); fi
  pgrep -f "valgrind.bin.*$work/cg.out" > "$work/tg.pid"
  h2load "${proto[@]}" "${hdr[@]}" -n 2000 -c 50 "$url" >/dev/null
  callgrind_control -i on "$(cat "$work/tg.pid")" >/dev/null 2>&1
  h2load "${proto[@]}" "${hdr[@]}" -n "$n" -c 50 "$url" | grep -E "^status codes" || true
  callgrind_control -d "$(cat "$work/tg.pid")" >/dev/null 2>&1
  kill "$(cat "$work/tg.pid")"; wait 2>/dev/null || true; rm "$work/tg.pid"
  ir=$(cat "$work"/cg.out.* | awk '/^summary:/{s+=$2} END{print s}')
  printf '%-50s %10.0f instructions/request\n' "$bin" "$(awk -v i="$ir" -v n="$n" 'BEGIN{print i/n}')"
  if [[ -n ${KEEP:-} ]]; then cat "$work"/cg.out.* > "$KEEP/$(basename "$bin").callgrind"; fi
  rm -f "$work"/cg.out*
done
