#!/usr/bin/env bash
# tollgate beside pingora (Cloudflare's proxy framework) in one harness run, with nginx and
# HAProxy as always: the pass, 429 and h2c rows side by side, the same interleaved rounds.
#
#   benches/pingora.sh                               # builds both (release), all scenarios
#   SCENARIOS=pass ROUNDS=5 benches/pingora.sh
#   TOLLGATE=/path/to/tollgate PINGORA=/path/to/pingora-yardstick benches/pingora.sh   # no builds
#
# pingora is a yardstick, not a target: benches/pingora/ is a minimal pingora proxy in its own
# cargo project (never part of tollgate's build, lints, tests or CI), built here into
# PINGORA_TARGET_DIR (default benches/pingora/target). Its first build compiles about 200
# crates and needs cmake (pingora-core's zlib-ng). It gets the candidate contract of
# benchmarks/harness.md as the harness's second candidate (CANDIDATE2_*); tollgate is the first,
# as in benches/load.sh. Instruction counts: benches/instr-peers.sh pingora.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
for t in nginx haproxy wrk h2load; do command -v $t >/dev/null || { echo "missing $t (benchmarks/README.md, what the scripts need)" >&2; exit 1; }; done

tollgate=${TOLLGATE:-}
if [[ -z $tollgate ]]; then
  cargo build --profile dist --quiet
  tollgate=${CARGO_TARGET_DIR:-$root/target}/dist/tollgate
fi
pingora=${PINGORA:-}
if [[ -z $pingora ]]; then
  target=${PINGORA_TARGET_DIR:-$root/benches/pingora/target}
  command -v cmake >/dev/null || { echo "missing cmake (pingora-core builds zlib-ng with it)" >&2; exit 1; }
  CARGO_TARGET_DIR=$target cargo build --release --quiet --locked --manifest-path benches/pingora/Cargo.toml
  pingora=$target/release/pingora-yardstick
fi
for b in "$tollgate" "$pingora"; do [[ -x $b ]] || { echo "not an executable: $b" >&2; exit 1; }; done

export CANDIDATE_NAME=tollgate CANDIDATE_PORT=18020 CANDIDATE_REJECT_PORT=18021 CANDIDATE_H2_PORT=18022
export CANDIDATE_CMD="$tollgate bench"
export CANDIDATE2_NAME=pingora CANDIDATE2_PORT=18030 CANDIDATE2_REJECT_PORT=18031 CANDIDATE2_H2_PORT=18032
export CANDIDATE2_CMD=$pingora
exec bash "$root/benches/harness/run.sh"
