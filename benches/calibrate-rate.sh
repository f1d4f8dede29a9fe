#!/usr/bin/env bash
# The highest rate one core of `tollgate calibrate` sends open-loop with accurate timing, beside
# wrk (closed loop: its best throughput, not a schedule) on the same core. The upstream is nginx
# answering `200 ok`, pinned to the other core, so the generator is what runs out.
#
#   benches/calibrate-rate.sh [target/dist/tollgate]
#   RATES=5000,10000,20000 STEP=3s benches/calibrate-rate.sh
#
# A step counts when its achieved rate is within 1 % of the offered one and the generator kept
# its schedule (dispatch lag p90 ≤ 10 ms: `generator_behind` false). Timings on a shared machine
# are noisy: run it on a quiet one for numbers to quote.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
bin=${1:-target/dist/tollgate}
rates=${RATES:-5000,10000,15000,20000,25000,30000,40000,50000}
step=${STEP:-3s}
for t in nginx taskset jq; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
start_upstream "$work" 18295 1
sleep 0.5
echo "calibrate, one worker thread pinned to CPU 0 (open loop; latency from the scheduled time):"
taskset -c 0 "$bin" calibrate http://127.0.0.1:18295/ --threads 1 --rates "$rates" --step-duration "$step" \
  --warmup 1s --slo-p99 1s --slo-errors 1% --stop-after-bad 1 --json > "$work/report.json" || true
jq -r '.steps[] | "  \(.rate)/s offered: achieved \(.achieved|floor)/s, p50 \(.p50_ms) ms, p99 \(.p99_ms) ms, generator_behind \(.generator_behind)"' "$work/report.json"
best=$(jq '[.steps[] | select(.generator_behind == false and .achieved >= 0.99 * .rate) | .rate] | max // 0' "$work/report.json")
echo "  highest accurate open-loop rate: ${best}/s"
if command -v wrk >/dev/null; then
  echo "wrk, one thread pinned to CPU 0, 50 connections (closed loop), 5 s:"
  taskset -c 0 wrk -t1 -c50 -d5s http://127.0.0.1:18295/ | grep -E "Requests/sec|Latency"
fi
