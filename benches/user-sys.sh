#!/usr/bin/env bash
# User and system CPU per request, nginx (the harness's proxy config: one worker, an
# upstream keep-alive pool, `limit_req` on the path) beside tollgate binaries in `bench`
# mode, on the pass path and the 429 path (1000/s, burst 100, as in the harness). It shows
# which part of a gap is user space (tollgate's and hyper's instructions, see instr.sh and
# instr-peers.sh) and which is the kernel's (syscalls, packets, wake-ups: wakeups.sh).
#
#   benches/user-sys.sh target/dist/tollgate [/tmp/old/tollgate...]   # ROUNDS=3 DURATION=8s
#
# Layout as in benches/ab.sh: the upstream and the proxies on core 0, wrk -t1 -c50 on core 1,
# each round measures every proxy in turn after a 2 s warm-up, CPU from /proc (utime, stime).
# No quiet gate: run it on a quiet machine, and read the user/system split more than the
# totals. BASE_PORT (default 18620) moves the ports used.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 BINARY..." >&2; exit 2; }
for t in nginx wrk taskset; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
bp=${BASE_PORT:-18620}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_upstream "$work" "$bp" 0
nginx_proxy_conf "$work/proxy.conf" "$bp" $((bp + 1)) $((bp + 2)) 1000 100 "" \
  "daemon on; pid $work/proxy.pid; error_log $work/proxy.log crit;"
taskset -c 0 nginx -c "$work/proxy.conf" -p "$work"
sleep 0.5
names=(nginx) pids=("$(pgrep -P "$(cat "$work/proxy.pid")" | head -1)") pass=($((bp + 1))) reject=($((bp + 2)))
i=0
for bin in "$@"; do
  p=$((bp + 10 + 2 * i))
  UPSTREAM_ADDR=127.0.0.1:$bp LISTEN_ADDR=127.0.0.1:$p REJECT_PORT=$((p + 1)) taskset -c 0 "$bin" bench >/dev/null 2>&1 &
  echo $! > "$work/t$i.pid"
  names+=("$bin") pids+=("$!") pass+=("$p") reject+=($((p + 1)))
  i=$((i + 1))
done
sleep 1
hz=$(getconf CLK_TCK)
measure() { # name pid port
  taskset -c 1 wrk -t1 -c50 -d2s "http://127.0.0.1:$3/" >/dev/null
  read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$2/stat")
  out=$(taskset -c 1 wrk -t1 -c50 -d"${DURATION:-8s}" "http://127.0.0.1:$3/")
  read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$2/stat")
  awk -v n="$(awk '/requests in/{print $1}' <<<"$out")" -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v hz="$hz" -v name="$1" \
    'BEGIN{printf "%-44s %9d req  user %5.2f  sys %5.2f  total %5.2f us/req\n", name, n, u*1e6/hz/n, s*1e6/hz/n, (u+s)*1e6/hz/n}'
}
for r in $(seq "${ROUNDS:-3}"); do
  echo "--- round $r"
  for path in pass reject; do
    for j in "${!names[@]}"; do
      port=${pass[$j]}; [[ $path == reject ]] && port=${reject[$j]}
      measure "$path ${names[$j]}" "${pids[$j]}" "$port"
    done
  done
done
