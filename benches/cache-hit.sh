#!/usr/bin/env bash
# CPU per cache hit: tollgate's `cache:` beside nginx proxy_cache, in one run.
#
#   benches/cache-hit.sh target/dist/tollgate        # N=100000 CONNS=8 ROUNDS=3
#
# One nginx upstream (one worker) serves a 1 KiB JSON answer with `Cache-Control: max-age=600`
# (and nginx's own ETag and Last-Modified) at /hit.json, and the same answer at /pass.json. In
# front of it, nginx (one worker, `proxy_cache` on a cache zone, keep-alive upstream pool) and
# tollgate (`tollgate run`, one worker, `cache: {}` on the route of /hit.json, no request ids)
# each answer /hit.json from their cache and forward /pass.json without one. Both proxies run
# on core 0; h2load (CONNS keep-alive HTTP/1.1 connections, N requests) and the upstream on
# core 1.
#
# Each proxy's key is warmed with two requests first. Then, per round and per proxy, h2load
# sends N requests for the hit, and N for the forwarded answer beside it (PASS=0 leaves that
# out): CPU per request is the proxy's utime + stime (from /proc, every thread) over the N
# requests. The upstream logs every request it gets: the script fails when the upstream saw a
# /hit.json request after the warm-up (then not every request was a hit). Rounds interleave
# the proxies; the medians are printed as a Markdown table with the ratio tollgate ÷ nginx.
#
# Environment: N (100000), CONNS (8), ROUNDS (3), PASS (1), BASE_PORT (18470: the upstream,
# nginx on +1, tollgate on +2), TOLLGATE_CACHE (the route's `cache:` value, `{}`), NGINX_CACHE_DIR
# (nginx's cache folder; default a folder in the temp dir, on tmpfs when /dev/shm exists, so that
# neither proxy touches a disk).
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 TOLLGATE_BINARY" >&2; exit 2; }
for t in nginx h2load curl taskset; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
bin=$(realpath "$1")
n=${N:-100000} conns=${CONNS:-8} rounds=${ROUNDS:-3} pass=${PASS:-1}
bp=${BASE_PORT:-18470}; up=$bp ngx=$((bp + 1)) tg=$((bp + 2))
for port in "$up" "$ngx" "$tg"; do
  if (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "port $port is in use (BASE_PORT)" >&2; exit 1; fi
done
tmp=/tmp; [[ -d /dev/shm && -w /dev/shm ]] && tmp=/dev/shm
work=$(mktemp -d "$tmp/cache-hit.XXXXXX")
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
# nginx's workers run as another user: they must reach the answers and the cache folder.
chmod 755 "$work"
mkdir -p "$work/www" "$work/up" "$work/ngx"

# 1 KiB of JSON, an API's answer.
body='{"id":46,"name":"cache-hit","items":['
i=0
while ((${#body} < 1000)); do body+="{\"n\":$i,\"v\":\"value-$i\"},"; i=$((i + 1)); done
body="${body%,}]"
while ((${#body} < 1023)); do body+=" "; done
body+="}"
printf '%s' "$body" >"$work/www/hit.json"
cp "$work/www/hit.json" "$work/www/pass.json"

cat >"$work/up/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/up.pid; error_log $work/up/error.log crit;
events { worker_connections 4096; }
http { access_log $work/up/access.log; keepalive_requests 1000000000; etag on;
  types { application/json json; }
  server { listen 127.0.0.1:$up; root $work/www;
    location / { add_header Cache-Control "max-age=600" always; } } }
NGX
taskset -c 1 nginx -c "$work/up/nginx.conf" -p "$work/up"

cache_dir=${NGINX_CACHE_DIR:-$work/ngx/cache}
cat >"$work/ngx/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/ngx.pid; error_log $work/ngx/error.log crit;
events { worker_connections 4096; }
http {
    access_log off; server_tokens off; keepalive_timeout 300s; keepalive_requests 1000000000;
    proxy_cache_path $cache_dir levels=1:2 keys_zone=hits:10m max_size=100m inactive=600m use_temp_path=off;
    upstream backend { server 127.0.0.1:$up; keepalive 64; keepalive_requests 1000000000; }
    proxy_http_version 1.1; proxy_set_header Connection "";
    server {
        listen 127.0.0.1:$ngx backlog=4096;
        location / { proxy_cache hits; proxy_pass http://backend; }
        location = /pass.json { proxy_pass http://backend; }
    }
}
NGX
taskset -c 0 nginx -c "$work/ngx/nginx.conf" -p "$work/ngx"

tg_cache=${TOLLGATE_CACHE:-'{}'}
cat >"$work/tollgate.yaml" <<YAML
listen: 127.0.0.1:$tg
server: { workers: 1 }
request_id: { enabled: false }
upstreams:
  up: { url: http://127.0.0.1:$up }
routes:
  - { name: pass, match: { path_prefix: /pass.json }, upstream: up }
  - { name: hit, upstream: up, cache: $tg_cache }
YAML
taskset -c 0 "$bin" run -c "$work/tollgate.yaml" 2>"$work/tollgate.log" &
echo $! >"$work/tollgate.pid"
for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$tg/pass.json" && break; sleep 0.1; done
curl -sf -o /dev/null "http://127.0.0.1:$tg/pass.json" || { echo "tollgate did not start:" >&2; cat "$work/tollgate.log" >&2; exit 1; }

# Warm each proxy's key: the first request stores, the second must be a hit already.
for port in "$ngx" "$tg"; do
  for _ in 1 2; do
    got=$(curl -s -o "$work/body" -w '%{http_code} %{size_download}' "http://127.0.0.1:$port/hit.json")
    [[ $got == "200 1024" ]] || { echo "127.0.0.1:$port/hit.json answered $got" >&2; exit 1; }
  done
done
upstream_hits() { grep -c 'GET /hit.json' "$work/up/access.log" || true; }
warm=$(upstream_hits)
((warm <= 2)) || { echo "the upstream saw $warm requests for /hit.json while warming (2 expected): is the cache on?" >&2; exit 1; }

hz=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
paths=(hit.json); [[ $pass == 1 ]] && paths+=(pass.json)
declare -A us rps
for r in $(seq "$rounds"); do
  for path in "${paths[@]}"; do
    for proxy in tollgate nginx; do
      port=$tg pid=$(cat "$work/tollgate.pid")
      # nginx's master forks the worker: the worker does the work.
      [[ $proxy == nginx ]] && port=$ngx pid=$(pgrep -P "$(cat "$work/ngx.pid")" | head -1)
      url="http://127.0.0.1:$port/$path"
      taskset -c 1 h2load --h1 -n 2000 -c "$conns" "$url" >/dev/null
      c0=$(cpu "$pid")
      out=$(taskset -c 1 h2load --h1 -n "$n" -c "$conns" "$url")
      c1=$(cpu "$pid")
      ok=$(awk '/^status codes:/{print $3}' <<<"$out")
      [[ $ok == "$n" ]] || { echo "$proxy $path: $ok of $n answered 2xx" >&2; exit 1; }
      v_us=$(awk -v t=$((c1 - c0)) -v hz="$hz" -v n="$n" 'BEGIN{printf "%.2f", t * 1e6 / hz / n}')
      v_rps=$(awk '/^finished in/{gsub(",", "", $4); printf "%.0f", $4}' <<<"$out")
      us[$path,$proxy]="${us[$path,$proxy]:-} $v_us"
      rps[$path,$proxy]="${rps[$path,$proxy]:-} $v_rps"
      printf 'round %d %-9s %-8s %8s req/s %7s µs CPU/req\n' "$r" "$path" "$proxy" "$v_rps" "$v_us"
    done
  done
done
after=$(upstream_hits)
((after == warm)) || { echo "the upstream saw $((after - warm)) requests for /hit.json during the runs: not every request was a hit" >&2; exit 1; }

median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo
echo "medians of $rounds rounds, $n requests a round over $conns connections; upstream requests for /hit.json after the warm-up: $((after - warm))"
echo
echo "| what | tollgate req/s | tollgate µs CPU/req | nginx req/s | nginx µs CPU/req | tollgate ÷ nginx (CPU) |"
echo "|---|---|---|---|---|---|"
for path in "${paths[@]}"; do
  what="cache hit (1 KiB JSON)"; [[ $path == pass.json ]] && what="forwarded, no cache (the same answer)"
  t=$(median "${us[$path,tollgate]}") g=$(median "${us[$path,nginx]}")
  rel=$(awk -v a="$t" -v b="$g" 'BEGIN{printf "%.2f", a / b}')
  echo "| $what | $(median "${rps[$path,tollgate]}") | $t | $(median "${rps[$path,nginx]}") | $g | $rel |"
done
