#!/usr/bin/env bash
# User-space instructions per request of the harness's peers, nginx and HAProxy, counted by
# callgrind exactly as benches/instr.sh counts tollgate's: the same nginx upstream, the same
# h2load load (2,000 warm-up requests, then N counted ones over 50 keep-alive connections),
# the same three paths. Their configs are benches/harness/run.sh's (one worker or thread, an
# upstream keep-alive pool, a per-client-IP limit on the path), except that the reject
# path's limit is 1/s as in instr.sh, so that next to nothing is admitted however slowly
# valgrind runs. Read the figures beside instr.sh's: what a path costs in user space when
# nginx or HAProxy takes it, the budget a CPU-per-request target leaves tollgate.
#
# pingora (benches/pingora/, a yardstick, not a target) is counted too when its binary is
# there: PINGORA, or benches/pingora/target/release/pingora-yardstick as benches/pingora.sh
# builds it; otherwise it is skipped with a message. Its threads are all counted (pingora's
# timer thread included), as nginx's and HAProxy's are.
#
#   benches/instr-peers.sh                       # nginx, haproxy and pingora, pass
#   PORT_VAR=REJECT_PORT benches/instr-peers.sh  # the 429 path
#   H2=1 benches/instr-peers.sh haproxy          # h2c, 10 streams a connection
#   TLS=1 benches/instr-peers.sh nginx           # pass over TLS 1.3, as benches/tls.sh's nginx
#                                                # terminates it (tickets and session cache off)
#
# BASE_PORT (default 18490) moves the ports used (upstream, pass, h2c, reject).
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
for t in nginx haproxy h2load valgrind callgrind_control; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
n=${N:-20000} port_var=${PORT_VAR:-LISTEN_ADDR}
proto=(--h1); [[ -n ${H2:-} ]] && proto=(-m 10)
peers=("$@"); [[ ${#peers[@]} -gt 0 ]] || peers=(nginx haproxy pingora)
pingora_bin=${PINGORA:-$(dirname "${BASH_SOURCE[0]}")/pingora/target/release/pingora-yardstick}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
bp=${BASE_PORT:-18490} up=$bp pass=$((bp + 1)) h2=$((bp + 2)) rej=$((bp + 3))
start_upstream "$work" "$up"
port=$pass; [[ -n ${H2:-} ]] && port=$h2; [[ $port_var == REJECT_PORT ]] && port=$rej

nginx_proxy_conf "$work/proxy-nginx.conf" "$up" "$pass" "$rej" 1 1 "$h2" \
  "master_process off; daemon off; pid $work/proxy-nginx.pidfile; error_log $work/proxy-nginx-error.log crit;"

haproxy_proxy_conf "$work/haproxy.cfg" "$up" "$pass" "$rej" 1 "$h2"

scheme=http
if [[ -n ${TLS:-} ]]; then
  [[ ${peers[*]} == nginx ]] || { echo "TLS=1 measures nginx only" >&2; exit 2; }
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench.test \
    -addext subjectAltName=DNS:bench.test -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
  sed -i "s|listen 127.0.0.1:$pass backlog=4096;|listen 127.0.0.1:$pass ssl backlog=4096; ssl_certificate $work/cert.pem; ssl_certificate_key $work/key.pem; ssl_protocols TLSv1.3; ssl_session_tickets off; ssl_session_cache off;|" \
    "$work/proxy-nginx.conf"
  scheme=https
fi

url=$scheme://127.0.0.1:$port/
for peer in "${peers[@]}"; do
  penv=()
  case $peer in
    nginx) cmd=(nginx -p "$work" -c "$work/proxy-nginx.conf") ;;
    haproxy) cmd=(haproxy -db -f "$work/haproxy.cfg") ;;
    pingora)
      if [[ ! -x $pingora_bin ]]; then
        echo "pingora: skipped, no binary at $pingora_bin (build it with benches/pingora.sh, or set PINGORA)" >&2
        continue
      fi
      # The candidate contract's environment; the reject limit is 1/s as for the other two.
      penv=(UPSTREAM_ADDR=127.0.0.1:$up LISTEN_ADDR=127.0.0.1:$pass REJECT_PORT=$rej H2_PORT=$h2
            REJECT_RATE=1 REJECT_BURST=1)
      cmd=("$pingora_bin") ;;
    *) echo "unknown peer $peer (nginx, haproxy or pingora)" >&2; exit 2 ;;
  esac
  env "${penv[@]}" valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.out" "${cmd[@]}" \
    >"$work/vg.log" 2>&1 &
  for _ in $(seq 100); do curl -sk -o /dev/null "$url" && break; sleep 0.2; done
  pgrep -f "valgrind.bin.*$work/cg.out" > "$work/peer.pid"
  h2load "${proto[@]}" -n 2000 -c 50 "$url" >/dev/null
  callgrind_control -i on "$(cat "$work/peer.pid")" >/dev/null 2>&1
  h2load "${proto[@]}" -n "$n" -c 50 "$url" | grep -E "^status codes" || true
  callgrind_control -d "$(cat "$work/peer.pid")" >/dev/null 2>&1
  kill "$(cat "$work/peer.pid")"; wait 2>/dev/null || true; rm "$work/peer.pid"
  ir=$(cat "$work"/cg.out.* | awk '/^summary:/{s+=$2} END{print s}')
  printf '%-50s %10.0f instructions/request\n' "$peer" "$(awk -v i="$ir" -v n="$n" 'BEGIN{print i/n}')"
  if [[ -n ${KEEP:-} ]]; then cat "$work"/cg.out.* > "$KEEP/$peer.callgrind"; fi
  rm -f "$work"/cg.out*
done
