#!/usr/bin/env bash
# The README's test command: installs what a fresh machine lacks, then runs format, lint and
# every test. Tests start their own redis-server processes (and a headless Chromium) on free
# loopback ports.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need() { command -v "$1" >/dev/null 2>&1; }
missing=()
need redis-server || missing+=(redis-server)
need redis-cli || missing+=(redis-tools)
# The guides' own commands (tests/it/guides.rs) run curl, and python3 for one of their lines.
need curl || missing+=(curl)
need python3 || missing+=(python3)
# The DNS discovery tests (tests/it/discovery.rs) start their own dnsmasq on a loopback port.
need dnsmasq || [[ -x /usr/sbin/dnsmasq ]] || missing+=(dnsmasq-base)
# The dashboard's browser test (tests/it/dashboard.rs) drives headless Chromium.
need chromium || missing+=(chromium)
need chromedriver || missing+=(chromium-driver)
sudo_cmd=()
[[ $(id -u) == 0 ]] || sudo_cmd=(sudo)
apt_updated=
if ((${#missing[@]})); then
  echo "==> installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  apt_updated=1
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The ACME tests (tests/it/acme.rs) run Pebble, Let's Encrypt's ACME test server, and its DNS
# (pebble-challtestsrv), as Debian packages them. Where they cannot be installed, those tests
# say they were skipped (TOLLGATE_SKIP_PEBBLE lets a CI run skip them).
if ! need pebble || ! need pebble-challtestsrv; then
  echo "==> installing pebble (Let's Encrypt's ACME test server)"
  [[ -n $apt_updated ]] || "${sudo_cmd[@]}" apt-get update -qq || true
  if ! DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq pebble >/dev/null; then
    echo "warning: pebble could not be installed; the ACME tests will say they were skipped"
    export TOLLGATE_SKIP_PEBBLE=1
  fi
fi
# Python modules of tests that use a client or decoder written elsewhere: aioquic for the
# HTTP/3 test (tests/h3/aioquic_client.py), brotli and zstandard for the compression tests'
# decoders (tests/it/compression.rs), websockets and grpcio for the message-limit tests' clients
# and gRPC upstream (tests/it/messages.rs). A test whose module is missing says it was skipped.
py_missing=()
if need python3; then
  for m in aioquic:aioquic brotli:brotli zstandard:zstandard websockets:websockets grpc:grpcio; do
    python3 -c "import ${m%%:*}" 2>/dev/null || py_missing+=("${m#*:}")
  done
fi
if ((${#py_missing[@]})); then
  echo "==> installing ${py_missing[*]} (pip)"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq python3-pip >/dev/null || true
  fi
  # A distribution's own Python refuses pip's installs (PEP 668) unless told otherwise.
  python3 -m pip install -q "${py_missing[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${py_missing[@]}" ||
    echo "warning: ${py_missing[*]} not installed; the tests that need them will say they were skipped"
fi
if need rustup; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

# A CI run builds once from scratch: incremental state would only take disk and time.
[[ -n ${CI:-} ]] && export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
if need docker && docker compose version >/dev/null 2>&1; then
  echo "==> docker compose config"
  docker compose -f docker-compose.yml config --quiet
elif need docker-compose; then
  echo "==> docker-compose config"
  docker-compose -f docker-compose.yml config --quiet
fi
echo "==> cargo test"
cargo test --quiet
