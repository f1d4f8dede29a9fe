#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets/) for SECONDS each, one after the other, one
# process each (the machine is shared). Not part of CI: it needs the nightly toolchain and
# cargo-fuzz (`cargo install cargo-fuzz --locked`).
#
#   scripts/fuzz.sh 60                 # every target for a minute
#   scripts/fuzz.sh 300 target config  # only these targets
#
# Seeds are read from fuzz/corpus/<target>/ and never written; what a run learns goes to
# $FUZZ_WORK_DIR/<target>/ (default fuzz/work/, git-ignored), which the next run starts from.
# A crash leaves its input in fuzz/artifacts/<target>/; replay it with
#   cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>
# and turn it into a unit test in src/fuzzing/regressions.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { echo "usage: $0 SECONDS [TARGET...]" >&2; exit 2; }
[[ $# -ge 1 && $1 =~ ^[0-9]+$ && $1 -gt 0 ]] || usage
seconds=$1
shift

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz.sh: the nightly toolchain is missing; cargo-fuzz needs it (rustup toolchain install nightly)." >&2
  exit 3
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: cargo-fuzz is missing (cargo install cargo-fuzz --locked)." >&2
  exit 3
fi

targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
work=${FUZZ_WORK_DIR:-fuzz/work}
# Overflow checks and debug assertions on: an overflow is a finding too. No sanitizer: the
# crate forbids unsafe code, and the fuzzer runs about twice as fast without one.
flags=(--release --debug-assertions --sanitizer none)

echo "==> building ${#targets[@]} targets"
mkdir -p "$work"
for t in "${targets[@]}"; do
  if ! cargo +nightly fuzz build "${flags[@]}" "$t" >"$work/build.log" 2>&1; then
    cat "$work/build.log"
    exit 1
  fi
done

failed=()
for t in "${targets[@]}"; do
  mkdir -p "$work/$t"
  dict=()
  [[ -f fuzz/dict/$t.dict ]] && dict=("-dict=fuzz/dict/$t.dict")
  echo "==> $t for ${seconds}s"
  # The first corpus directory receives new inputs; the seeds stay as they are.
  log=$work/$t.log
  if cargo +nightly fuzz run "${flags[@]}" "$t" "$work/$t" "fuzz/corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 "${dict[@]}" \
    >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
    echo "    $t: ok, ${runs:-?} runs, ${cov:-cov: ?}, $(find "$work/$t" -type f | wc -l) inputs in $work/$t"
  else
    tail -n 40 "$log"
    echo "    $t: FAILED (log $log, input in fuzz/artifacts/$t/)"
    failed+=("$t")
  fi
done

if ((${#failed[@]})); then
  echo "fuzz.sh: crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: ${#targets[@]} targets, ${seconds}s each, no crash"
