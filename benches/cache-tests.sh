#!/usr/bin/env bash
# The HTTP caching test suite (http-tests/cache-tests, the suite behind cache-tests.fyi) against
# nginx proxy_cache, Varnish and, when given, tollgate; one table of the results.
#
#   benches/cache-tests.sh                                            # nginx and Varnish only
#   benches/cache-tests.sh target/release/tollgate examples/cache.yaml
#
# The suite is a Node.js program in two halves: its own origin server (the suite's `npm run
# server`), and a client (`npm run cli --base=URL`) that sends each test's requests to a base URL
# and checks what comes back (from the cache or from the origin: the origin numbers its answers).
# Each proxy here is a reverse proxy whose upstream is that origin, and the client is pointed at
# the proxy. The proxies run one after another against the same origin:
#
#   nginx     proxy_cache, the settings the suite's own image uses for cache-tests.fyi (a cache
#             zone, `proxy_cache_revalidate on`, HTTP/1.1 upstream), nothing else: no caching of
#             answers without freshness (`proxy_cache_valid` unset), PUT and POST passed through
#   varnish   the packaged default VCL (the built-in VCL under it) with its backend set to the
#             origin, and `default_ttl=0 default_grace=0 default_keep=3600` (VARNISH_PARAMS): the
#             packaged defaults cache an answer without any freshness for 120 s and serve stale
#             10 s past every TTL, which a shared cache must not (RFC 9111 4.2.2, 4.2.4);
#             stale-while-revalidate still gives grace, and `keep` holds a stale copy for
#             revalidation (without it Varnish sends no conditional request)
#   tollgate  `BINARY run -c CONFIG`, CONFIG a file listening on 127.0.0.1:8080 with every route
#             cached and upstream http://127.0.0.1:8000 (as examples/cache.yaml); when the ports
#             below differ from those, the script runs a copy with the two addresses rewritten
#
# Output: one Markdown table, per suite section the passed / failed / optional-failed counts of
# each proxy (results read as cache-tests.fyi reads them: a test whose dependency failed counts as
# "dep", not as a failure), and the list of the tests tollgate fails (id, name, the suite's
# message, and what nginx and Varnish did on the same test). The raw results (the suite's JSON,
# one file a proxy) stay in the results folder named at the end.
#
# Environment:
#   PROXIES         which of nginx, varnish to run (default "nginx varnish"); tollgate is run when
#                   BINARY and CONFIG are given
#   SERVER_PORT     the suite's origin (8000)       CANDIDATE_PORT  tollgate (8080)
#   NGINX_PORT      nginx (8081)                    VARNISH_PORT    Varnish (8082)
#   VARNISH_PARAMS  varnishd's -p settings (default above; empty: the packaged defaults)
#   OUT             the results folder (default: a new mktemp -d folder, kept)
#   CACHE_TESTS_GIT where the suite is cloned from (default https://github.com/http-tests/cache-tests.git;
#                   without access to GitHub, a local clone or mirror of it: a path works too)
#   CACHE_TESTS_COMMIT  the pinned commit (default below; the table is only comparable within a commit)
#   CACHE_TESTS_DIR an existing checkout to use instead of cloning (its commit is printed)
#   ID              run one test only, with the suite's request and response dump (debugging)
#   NO_INSTALL=1    do not apt-get install what is missing
#
# Needs: Node.js 18 or newer with npm, git, nginx, varnishd, curl; on Debian or Ubuntu the script
# installs the missing ones with apt-get (nodejs npm git nginx varnish curl), and the suite's one
# runtime dependency (undici, for its interim-response tests) with npm from the npm registry into
# the results folder. Nothing is installed globally by npm; no system service is started.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
suite_git=${CACHE_TESTS_GIT:-https://github.com/http-tests/cache-tests.git}
suite_commit=${CACHE_TESTS_COMMIT:-b55b8bda3dbb8c927c04e85bd8d496a8caa3e4ba} # 2026-07-20
undici_version=7.30.3 # the suite's package.json asks for ^7.4.0
server_port=${SERVER_PORT:-8000} candidate_port=${CANDIDATE_PORT:-8080}
nginx_port=${NGINX_PORT:-8081} varnish_port=${VARNISH_PORT:-8082}
read -r -a proxies <<<"${PROXIES-nginx varnish}"
varnish_params=()
for v in ${VARNISH_PARAMS-default_ttl=0 default_grace=0 default_keep=3600}; do varnish_params+=(-p "$v"); done

bin="" config=""
case $# in
  0) ;;
  2) bin=$(realpath "$1") config=$(realpath "$2")
     [[ -x $bin ]] || { echo "$1 is not an executable" >&2; exit 2; }
     [[ -f $config ]] || { echo "$2 is not a file" >&2; exit 2; }
     proxies+=(tollgate) ;;
  *) echo "usage: $0 [TOLLGATE_BINARY CONFIG]" >&2; exit 2 ;;
esac

# What is missing, installed from the distribution (Debian 12 has Node.js 18, nginx 1.22, Varnish 7.1).
need=()
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v git >/dev/null || need+=(git)
command -v curl >/dev/null || need+=(curl)
for p in "${proxies[@]}"; do
  case $p in
    nginx) command -v nginx >/dev/null || PATH=$PATH:/usr/sbin command -v nginx >/dev/null || need+=(nginx) ;;
    varnish) command -v varnishd >/dev/null || PATH=$PATH:/usr/sbin command -v varnishd >/dev/null || need+=(varnish) ;;
    tollgate) ;;
    *) echo "unknown proxy $p (PROXIES takes nginx and varnish)" >&2; exit 2 ;;
  esac
done
if ((${#need[@]})); then
  if [[ -n ${NO_INSTALL:-} ]] || ! command -v apt-get >/dev/null; then echo "missing: ${need[*]}" >&2; exit 1; fi
  sudo=(); [[ $(id -u) == 0 ]] || sudo=(sudo)
  echo "installing ${need[*]} with apt-get" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
PATH=$PATH:/usr/sbin
node_major=$(node -p 'process.versions.node.split(".")[0]')
((node_major >= 18)) || { echo "Node.js $(node -v) is too old: the suite's client needs fetch (Node.js 18+)" >&2; exit 1; }

# Every port must be free: a proxy already there would answer in place of the one measured.
for port in "$server_port" "$candidate_port" "$nginx_port" "$varnish_port"; do
  if (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is in use (SERVER_PORT, CANDIDATE_PORT, NGINX_PORT, VARNISH_PORT choose others)" >&2
    exit 1
  fi
done

out=${OUT:-$(mktemp -d /tmp/cache-tests.XXXXXX)}
mkdir -p "$out/run"
out=$(realpath "$out")
run=$out/run
# nginx's workers and Varnish's child run as other users: they must reach their folders.
chmod 755 "$out" "$run"
pids=()
stop() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for f in "$run"/*.pid; do [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null; done
  true
}
trap stop EXIT

# The suite, at its pinned commit; undici beside it (the client imports it by name, and Node.js
# finds it in the parent folder's node_modules).
if [[ -n ${CACHE_TESTS_DIR:-} ]]; then
  suite=$(realpath "$CACHE_TESTS_DIR")
else
  suite=$out/cache-tests
  if [[ ! -d $suite/.git ]]; then
    git clone -q "$suite_git" "$suite" || {
      echo "could not clone $suite_git: set CACHE_TESTS_GIT to a reachable clone or mirror of" \
        "github.com/http-tests/cache-tests that has commit $suite_commit" >&2
      exit 1
    }
  fi
  git -C "$suite" checkout -q "$suite_commit"
fi
echo "suite: $(git -C "$suite" log -1 --format='%h %cs' 2>/dev/null || echo "$suite")" >&2
deps=$(dirname "$suite")
if [[ ! -d $deps/node_modules/undici ]]; then
  npm install --prefix "$deps" --no-save --no-package-lock --no-audit --no-fund --ignore-scripts \
    "undici@$undici_version" >/dev/null
fi

# The suite's server listens on every interface; this keeps it (and anything else Node starts
# here) on loopback.
cat >"$run/loopback.mjs" <<'JS'
import net from 'node:net'
const listen = net.Server.prototype.listen
net.Server.prototype.listen = function (...args) {
  if ((typeof args[0] === 'number' || /^[0-9]+$/.test(args[0])) && typeof args[1] !== 'string') {
    args.splice(0, 1, Number(args[0]), '127.0.0.1')
  }
  return listen.apply(this, args)
}
JS
(cd "$suite" && exec env npm_config_protocol=http npm_config_port="$server_port" \
  npm_config_pidfile="$run/origin.pid" node --import "$run/loopback.mjs" test-engine/server/server.mjs) \
  >"$run/origin.log" 2>&1 &
pids+=($!)

wait_for() { # URL NAME LOG
  for _ in $(seq 100); do
    curl -s -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "$2 did not start:" >&2
  cat "$3" >&2
  exit 1
}
wait_for "http://127.0.0.1:$server_port/" "the suite's server" "$run/origin.log"

start_nginx() {
  mkdir -p "$run/nginx"
  cat >"$run/nginx/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $run/nginx.pid; error_log $run/nginx/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    proxy_cache_path $run/nginx/cache levels=1:2 keys_zone=cache-tests:8m max_size=1000m inactive=600m;
    proxy_temp_path $run/nginx/tmp;
    server {
        listen 127.0.0.1:$nginx_port;
        location / {
            proxy_pass http://127.0.0.1:$server_port;
            proxy_cache cache-tests;
            proxy_cache_revalidate on;
            proxy_http_version 1.1;
        }
    }
}
NGX
  nginx -c "$run/nginx/nginx.conf" -p "$run/nginx" -e "$run/nginx/error.log"
}

start_varnish() {
  mkdir -p "$run/varnish"
  sed -e "s/\.host = \".*\";/.host = \"127.0.0.1\";/" -e "s/\.port = \".*\";/.port = \"$server_port\";/" \
    /etc/varnish/default.vcl >"$run/varnish.vcl" 2>/dev/null || cat >"$run/varnish.vcl" <<VCL
vcl 4.1;
backend default { .host = "127.0.0.1"; .port = "$server_port"; }
VCL
  grep -q "\"$server_port\"" "$run/varnish.vcl"
  varnishd -a "127.0.0.1:$varnish_port" -T "127.0.0.1:0" -n "$run/varnish" -f "$run/varnish.vcl" \
    -s malloc,256m "${varnish_params[@]}" -P "$run/varnish.pid" >"$run/varnish.log" 2>&1
}

start_tollgate() {
  local cfg=$config
  if [[ $server_port != 8000 || $candidate_port != 8080 ]]; then
    cfg=$run/tollgate.yaml
    sed -e "s/127\.0\.0\.1:8000/127.0.0.1:$server_port/g" -e "s/127\.0\.0\.1:8080/127.0.0.1:$candidate_port/g" \
      "$config" >"$cfg"
  fi
  (cd "$(dirname "$config")" && exec "$bin" run -c "$cfg") >"$run/tollgate.log" 2>&1 &
  echo $! >"$run/tollgate.pid"
}

port_of() { case $1 in nginx) echo "$nginx_port" ;; varnish) echo "$varnish_port" ;; tollgate) echo "$candidate_port" ;; esac; }

for p in "${proxies[@]}"; do
  "start_$p"
  port=$(port_of "$p")
  log=$run/$p.log; [[ $p == nginx ]] && log=$run/nginx/error.log
  wait_for "http://127.0.0.1:$port/" "$p" "$log"
  echo "running the suite against $p on 127.0.0.1:$port" >&2
  start=$(date +%s)
  if [[ -n ${ID:-} ]]; then
    (cd "$suite" && npm_config_base="http://127.0.0.1:$port" npm_config_id="$ID" node --no-warnings test-engine/cli.mjs)
  else
    (cd "$suite" && npm_config_base="http://127.0.0.1:$port" npm_package_config_id="" \
      node --no-warnings test-engine/cli.mjs) >"$out/$p.json" 2>"$run/$p.client.log"
    echo "  $(node -p "Object.keys(require('$out/$p.json')).length") results in $(($(date +%s) - start)) s" >&2
  fi
  kill "$(cat "$run/$p.pid")"
  rm -f "$run/$p.pid"
done

versions=()
for p in "${proxies[@]}"; do
  case $p in
    nginx) versions+=("nginx=$(nginx -v 2>&1 | sed 's/.*nginx\///')") ;;
    varnish) versions+=("varnish=$(varnishd -V 2>&1 | sed -n 's/.*varnish-\([^ ]*\).*/\1/p' | head -1)") ;;
    tollgate) versions+=("tollgate=$("$bin" --version 2>/dev/null | awk '{print $NF}')") ;;
  esac
done
[[ -n ${ID:-} ]] && exit 0
node "$here/cache-tests-summary.mjs" "$suite" "$out" "${versions[@]}" | tee "$out/summary.md"
echo >&2
echo "results: $out (one JSON a proxy, summary.md; the suite in $suite)" >&2
