#!/usr/bin/env bash
# The seed's retry storm, reproduced (docs/concepts/retry-storms.md): a slow upstream at its
# knee (WORKERS slots of SERVICE_MS each, an unbounded queue; capacity WORKERS × 1000 / SERVICE_MS
# a second) behind tollgate, and an open-loop population of clients at BASE × capacity with a
# spike at SPIKE × capacity, whose every request is retried naively through two layers (3 app
# tries × 3 SDK tries, no jitter, no backoff, Retry-After slept by the SDK). Three modes, same
# clients, same upstream, tollgate started afresh with the config of each:
#
#   plain   tollgate as a proxy whose group retries a try that passed 500 ms (no budget)
#   limits  + a token bucket at LIMIT/s (95 % of capacity) answering 429 with its honest Retry-After
#   full    + retry_after_spread, a retry budget on the group, adaptive concurrency
#
# and, one protection at a time on top of limits (MODES=budget,spread,adaptive), budget, spread
# and adaptive.
#
# Two scenarios, each through the three modes:
#
#   spike     the intended load at BASE × capacity, SPIKE × capacity for SPIKE_FOR s (the seed's trigger)
#   slowdown  the intended load at BASE × capacity; the upstream's service time SLOW_FACTOR times
#             longer from SLOW_AT for SLOW_FOR s (its capacity falls below the configured limit)
#
#   benches/retry-storm.sh                      # builds dist, runs both scenarios, ~4 min
#   DURATION=20 SCENARIOS=spike MODES=plain,full OUT=/tmp/storm benches/retry-storm.sh
#
# Writes OUT/SCENARIO/report.md (the table), report.json (every figure and per-second series),
# chart.svg and each mode's tollgate config. Knobs: DURATION (s of intended load, 30),
# WORKERS (10), SERVICE_MS (50), BASE (0.9), SPIKE (1.5), SPIKE_AT (5), SPIKE_FOR (4),
# SLOW_FACTOR (2), SLOW_AT (5), SLOW_FOR (10),
# LIMIT (requests/s, 95 % of capacity), SPREAD (5s), BUDGET_RATIO (0.1), BASE_PORT (18700),
# BIN (target/dist/tollgate), EXAMPLE (target/dist/examples/retry_storm), NO_BUILD=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
duration=${DURATION:-30}
workers=${WORKERS:-10}
service_ms=${SERVICE_MS:-50}
base=${BASE:-0.9}
spike=${SPIKE:-1.5}
spike_at=${SPIKE_AT:-5}
spike_for=${SPIKE_FOR:-4}
slow_factor=${SLOW_FACTOR:-2}
slow_at=${SLOW_AT:-5}
slow_for=${SLOW_FOR:-10}
scenarios=${SCENARIOS:-spike,slowdown}
capacity=$((workers * 1000 / service_ms))
limit=${LIMIT:-$((capacity * 95 / 100))}
spread=${SPREAD:-5s}
budget_ratio=${BUDGET_RATIO:-0.1}
port=${BASE_PORT:-18700}
modes=${MODES:-plain,limits,full}
out=${OUT:-target/retry-storm}
bin=${BIN:-target/dist/tollgate}
example=${EXAMPLE:-target/dist/examples/retry_storm}
if [[ -z ${NO_BUILD:-} ]]; then
  cargo build --profile dist --bin tollgate --example retry_storm
fi
# Every timed-out try is a connection closed; thousands are open at the storm's height.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
mkdir -p "$out"
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT

# The mode's tollgate config: a group of the upstream's two ports (one pool of workers behind
# both), so that tollgate's retry of a slow try has "another server" to go to.
config() {
  local mode=$1 up=$2 gw=$3 budget route_extra=""
  budget="{ ratio: 1000, min_per_s: 1000000 }" # the largest allowed: no budget
  local limit_line="    limits:
      - { name: capacity, algorithm: token_bucket, rate: ${limit}/s, burst: 20 }"
  local spread_line="    retry_after_spread: ${spread}"
  local adaptive_line="    concurrency: { adaptive: { min: 4, max: 200 }, max_wait: 50ms }"
  local budget_on="{ ratio: ${budget_ratio}, min_per_s: 1 }"
  case $mode in
    plain) ;;
    limits) route_extra=$limit_line ;;
    budget) route_extra=$limit_line budget=$budget_on ;;
    spread) route_extra="$limit_line
$spread_line" ;;
    adaptive) route_extra="$limit_line
$adaptive_line" ;;
    full)
      budget=$budget_on
      route_extra="$limit_line
$spread_line
$adaptive_line" ;;
    *) echo "unknown mode $mode (plain, limits, budget, spread, adaptive, full)" >&2; exit 2 ;;
  esac
  cat <<YAML
# benches/retry-storm.sh, mode $mode
listen: 127.0.0.1:$gw
upstreams:
  app:
    servers: [{ url: 'http://127.0.0.1:$up' }, { url: 'http://127.0.0.1:$((up + 1))' }]
    timeout: 1s
    outlier: { consecutive_failures: 0 }
    retry: { attempts: 2, on: [connect_failure, 502, 503, 504], per_try_timeout: 500ms, budget: $budget }
routes:
  - name: api
    upstream: app
$route_extra
YAML
}

describe() {
  case $1 in
    plain) echo "tollgate as a proxy; its group retries a try that passed 500 ms on the other port (2 tries, no budget)" ;;
    limits) echo "plain + a token bucket at ${limit}/s (burst 20) answering 429 with its honest Retry-After" ;;
    budget) echo "limits + a retry budget on the group (ratio ${budget_ratio}, 1/s)" ;;
    spread) echo "limits + retry_after_spread ${spread}" ;;
    adaptive) echo "limits + adaptive concurrency (max_wait 50ms)" ;;
    full) echo "limits + retry_after_spread ${spread}, a retry budget (ratio ${budget_ratio}, 1/s), adaptive concurrency (max_wait 50ms)" ;;
  esac
}

i=0
IFS=, read -ra modes_list <<< "$modes"
IFS=, read -ra scenario_list <<< "$scenarios"
for scenario in "${scenario_list[@]}"; do
  case $scenario in
    spike)
      shape=(--spike "$spike" --spike-at "$spike_at" --spike-for "$spike_for")
      title="A spike to ${spike} × capacity for ${spike_for} s" ;;
    slowdown)
      shape=(--spike "$base" --slow-factor "$slow_factor" --slow-at "$slow_at" --slow-for "$slow_for")
      title="The upstream ${slow_factor} × slower for ${slow_for} s" ;;
    *) echo "unknown scenario $scenario (spike, slowdown)" >&2; exit 2 ;;
  esac
  dir=$out/$scenario
  mkdir -p "$dir"
  files=()
  for mode in "${modes_list[@]}"; do
    up=$((port + 10 + 2 * i)) gw=$((port + 50 + i))
    for p in "$up" $((up + 1)) "$gw"; do
      if (exec 3<> "/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
        echo "port $p is in use: not measuring someone else's server (BASE_PORT=…)" >&2; exit 1
      fi
    done
    config "$mode" "$up" "$gw" > "$dir/$mode.yaml"
    "$bin" check -c "$dir/$mode.yaml" > /dev/null
    RUST_LOG=error "$bin" -c "$dir/$mode.yaml" > "$work/$mode.log" 2>&1 &
    echo $! > "$work/tollgate.pid"
    for _ in $(seq 100); do (exec 3<> "/dev/tcp/127.0.0.1/$gw") 2>/dev/null && break; sleep 0.1; done
    echo "== $scenario, $mode: $(describe "$mode")" >&2
    "$example" run --mode "$mode" --describe "$(describe "$mode")" --upstream-port "$up" \
      --target "http://127.0.0.1:$gw/" --out "$dir/$mode.json" --duration "$duration" \
      --workers "$workers" --service-ms "$service_ms" --base "$base" "${shape[@]}"
    kill "$(cat "$work/tollgate.pid")" 2>/dev/null || true
    wait "$(cat "$work/tollgate.pid")" 2>/dev/null || true
    rm -f "$work/tollgate.pid"
    files+=("$dir/$mode.json")
    i=$((i + 1))
    sleep 2
  done
  echo "== $scenario" >&2
  "$example" report --out "$dir" --title "$title" "${files[@]}"
done
echo "reports: $out/*/report.md, report.json, chart.svg" >&2
