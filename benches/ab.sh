#!/usr/bin/env bash
# Interleaved A/B of tollgate binaries in `bench` mode behind one nginx upstream.
#
#   benches/ab.sh /tmp/old/tollgate target/dist/tollgate     # ROUNDS=5 DURATION=8s PATH_=/
#   benches/ab.sh "BENCH_LEASE=100 BENCH_REDIS_URL=redis://127.0.0.1:16400 target/dist/tollgate" ...
#
# A candidate is a binary, optionally preceded by VAR=value words (run through `env`).
# The upstream (nginx, `return 200`) and every candidate share core 0, wrk -t1 -c50 runs on
# core 1; each round measures every binary once, in turn, after a 2 s warm-up. CPU per request
# comes from /proc (utime + stime) of the candidate process, its user-space part (utime) beside it. There is no quiet gate as in
# benches/harness/run.sh, so absolute figures run ~10% high: use the differences between binaries
# measured in the same rounds, and the harness for figures you quote.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 [VAR=value...] BINARY..." >&2; exit 2; }
for t in nginx wrk taskset; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
rounds=${ROUNDS:-5} duration=${DURATION:-8s} path=${PATH_:-/}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_upstream "$work" 18190 0
bins=("$@")
for i in "${!bins[@]}"; do
  # shellcheck disable=SC2086 # a candidate is words: VAR=value... binary
  UPSTREAM_ADDR=127.0.0.1:18190 LISTEN_ADDR=127.0.0.1:$((18191 + i)) taskset -c 0 env ${bins[$i]} bench &
  echo $! > "$work/c$i.pid"
done
sleep 1
cpu() { awk '{print $14, $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
declare -A results rates users
for r in $(seq "$rounds"); do
  for i in "${!bins[@]}"; do
    url="http://127.0.0.1:$((18191 + i))$path" pid=$(cat "$work/c$i.pid")
    taskset -c 1 wrk -t1 -c50 -d2s "$url" >/dev/null
    read -r u0 s0 < <(cpu "$pid"); out=$(taskset -c 1 wrk -t1 -c50 -d"$duration" "$url"); read -r u1 s1 < <(cpu "$pid")
    reqs=$(awk '/requests in/{print $1}' <<<"$out"); rps=$(awk '/Requests\/sec/{printf "%.0f", $2}' <<<"$out")
    us=$(awk -v t=$((u1 + s1 - u0 - s0)) -v n="$reqs" -v hz="$hz" 'BEGIN{printf "%.2f", t * 1e6 / hz / n}')
    user=$(awk -v t=$((u1 - u0)) -v n="$reqs" -v hz="$hz" 'BEGIN{printf "%.2f", t * 1e6 / hz / n}')
    results[$i]="${results[$i]:-} $us" rates[$i]="${rates[$i]:-} $rps" users[$i]="${users[$i]:-} $user"
    printf 'round %d  %-40s %8s req/s %6s us/req (user %s)\n' "$r" "${bins[$i]##*/}" "$rps" "$us" "$user"
  done
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo "--- medians (us/req per round; user-space part beside it)"
for i in "${!bins[@]}"; do
  printf '%-60s %8s req/s %6s us/req  user %5s  (%s )\n' "${bins[$i]}" "$(median "${rates[$i]}")" \
    "$(median "${results[$i]}")" "$(median "${users[$i]}")" "${results[$i]}"
done
