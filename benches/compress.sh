#!/usr/bin/env bash
# Compression beside nginx's gzip, in one run: CPU per MB compressed and the ratio, for gzip at
# equal levels (nginx and tollgate), and brotli and zstd (tollgate).
#
#   benches/compress.sh target/release/tollgate     # N=3000 ROUNDS=3 GZIP="1 4 6" BR="4" ZSTD="3"
#
# One nginx upstream serves two payloads made by benches/compress-payload.py (an API's JSON
# answer, 256 KiB, and an HTML page, 96 KiB). In front of it, nginx (gzip on, one worker,
# `gzip_comp_level` per location) and tollgate (`tollgate run`, one worker, `compression:` per
# route, `strip_prefix`) proxy the same paths: /gzL/ is gzip at level L, /brL/ brotli, /zsL/
# zstd, /id/ no compression. Both proxies share core 0; h2load (8 keep-alive HTTP/1.1
# connections, N requests) and the upstream run on core 1.
#
# CPU per MB: the proxy's utime + stime (from /proc) over N requests, divided by the MB of
# payload it compressed (the uncompressed size: the same work unit for every level and coding).
# `net` subtracts the same proxy's CPU per MB when it only proxies (/id/, no Accept-Encoding):
# the encoder's own cost. Ratio: compressed bytes ÷ payload bytes, as curl receives them.
# Rounds interleave the two proxies; the medians are printed as a Markdown table.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 TOLLGATE_BINARY" >&2; exit 2; }
for t in nginx h2load curl taskset python3; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
bin=$(realpath "$1")
n=${N:-3000} rounds=${ROUNDS:-3} gzip_levels=${GZIP-1 4 6} br_levels=${BR-4} zstd_levels=${ZSTD-3}
bp=${BASE_PORT:-18360}; up=$bp ngx=$((bp + 1)) tg=$((bp + 2))
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
# nginx's workers run as another user: they must reach the payloads.
chmod 755 "$work"
mkdir -p "$work/www" "$work/up" "$work/ngx"
python3 "$(dirname "${BASH_SOURCE[0]}")/compress-payload.py" "$work/www"

cat > "$work/up/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/up.pid; error_log $work/up/error.log crit;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000000; etag on;
  types { application/json json; text/html html; }
  server { listen 127.0.0.1:$up; root $work/www; } }
NGX
taskset -c 1 nginx -c "$work/up/nginx.conf" -p "$work/up"

locations="" routes=""
for l in $gzip_levels; do
  locations+="location /gz$l/ { gzip_comp_level $l; proxy_pass http://backend/; }
"
  routes+="  - { name: gz$l, match: { path_prefix: /gz$l/ }, upstream: up, strip_prefix: true, compression: { encodings: [gzip], levels: { gzip: $l } } }
"
done
for l in $br_levels; do
  routes+="  - { name: br$l, match: { path_prefix: /br$l/ }, upstream: up, strip_prefix: true, compression: { encodings: [br], levels: { br: $l } } }
"
done
for l in $zstd_levels; do
  routes+="  - { name: zs$l, match: { path_prefix: /zs$l/ }, upstream: up, strip_prefix: true, compression: { encodings: [zstd], levels: { zstd: $l } } }
"
done
cat > "$work/ngx/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/ngx.pid; error_log $work/ngx/error.log crit;
events { worker_connections 4096; }
http {
    access_log off; server_tokens off; keepalive_timeout 300s; keepalive_requests 1000000000;
    upstream backend { server 127.0.0.1:$up; keepalive 64; keepalive_requests 1000000000; }
    proxy_http_version 1.1; proxy_set_header Connection "";
    gzip on; gzip_types application/json; gzip_min_length 1024; gzip_vary on;
    server {
        listen 127.0.0.1:$ngx backlog=4096;
        location /id/ { gzip off; proxy_pass http://backend/; }
        $locations
    }
}
NGX
taskset -c 0 nginx -c "$work/ngx/nginx.conf" -p "$work/ngx"

cat > "$work/tollgate.yaml" <<YAML
listen: 127.0.0.1:$tg
server: { workers: 1 }
request_id: { enabled: false }
upstreams:
  up: { url: http://127.0.0.1:$up }
routes:
  - { name: id, match: { path_prefix: /id/ }, upstream: up, strip_prefix: true }
$routes
YAML
taskset -c 0 "$bin" run -c "$work/tollgate.yaml" 2>"$work/tollgate.log" &
echo $! > "$work/tollgate.pid"
for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$tg/id/payload.json" && break; sleep 0.1; done
curl -sf -o /dev/null "http://127.0.0.1:$tg/id/payload.json" || { echo "tollgate did not start:" >&2; cat "$work/tollgate.log" >&2; curl -si "http://127.0.0.1:$tg/id/payload.json" | head -20 >&2; curl -si "http://127.0.0.1:$up/payload.json" | head -5 >&2; ls -la "$work/www" >&2; exit 1; }

# Variants: name, path prefix, Accept-Encoding, which proxies.
variants=("id /id/ - both")
for l in $gzip_levels; do variants+=("gzip-$l /gz$l/ gzip both"); done
for l in $br_levels; do variants+=("br-$l /br$l/ br tollgate"); done
for l in $zstd_levels; do variants+=("zstd-$l /zs$l/ zstd tollgate"); done

hz=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
declare -A ms ratio
# Calls "$1" once per measured cell (payload, variant, proxy), with payload, size, name, hdr,
# proxy and url set.
each_cell() {
  local v which port
  for payload in payload.json payload.html; do
    size=$(stat -c %s "$work/www/$payload")
    for v in "${variants[@]}"; do
      read -r name prefix ae which <<<"$v"
      hdr=(); [[ $ae != - ]] && hdr=(-H "Accept-Encoding: $ae")
      for proxy in tollgate nginx; do
        [[ $which == both || $which == "$proxy" ]] || continue
        port=$tg; [[ $proxy == nginx ]] && port=$ngx
        url="http://127.0.0.1:$port$prefix$payload"
        "$1"
      done
    done
  done
}
measure_ratio() {
  local got
  got=$(curl -s "${hdr[@]}" -o "$work/body" -w '%{size_download}' "$url")
  ratio[$payload,$name,$proxy]=$(awk -v a="$got" -v b="$size" 'BEGIN{printf "%.3f", a / b}')
}
measure_cpu() {
  local pid c0 c1 out ok v_ms
  pid=$(cat "$work/$([[ $proxy == nginx ]] && echo ngx || echo tollgate).pid")
  # nginx's master forks the worker: the worker does the work.
  [[ $proxy == nginx ]] && pid=$(pgrep -P "$pid" | head -1)
  taskset -c 1 h2load --h1 -n 200 -c 8 "${hdr[@]}" "$url" >/dev/null
  c0=$(cpu "$pid")
  out=$(taskset -c 1 h2load --h1 -n "$n" -c 8 "${hdr[@]}" "$url")
  c1=$(cpu "$pid")
  ok=$(awk '/^requests:/{print $8}' <<<"$out")
  [[ $ok == "$n" ]] || { echo "$proxy $name $payload: $ok of $n succeeded" >&2; exit 1; }
  v_ms=$(awk -v t=$((c1 - c0)) -v hz="$hz" -v n="$n" -v s="$size" 'BEGIN{printf "%.2f", t * 1000 / hz / (n * s / 1e6)}')
  ms[$payload,$name,$proxy]="${ms[$payload,$name,$proxy]:-} $v_ms"
  printf 'round %d %-13s %-8s %-9s %7s ms/MB  ratio %s\n' "$r" "$payload" "$name" "$proxy" "$v_ms" \
    "${ratio[$payload,$name,$proxy]}"
}
each_cell measure_ratio
for r in $(seq "$rounds"); do
  each_cell measure_cpu
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo
echo "| payload | coding | tollgate ratio | tollgate ms CPU/MB (net) | nginx ratio | nginx ms CPU/MB (net) | tollgate ÷ nginx (net) |"
echo "|---|---|---|---|---|---|---|"
for payload in payload.json payload.html; do
  tid=$(median "${ms[$payload,id,tollgate]}") nid=$(median "${ms[$payload,id,nginx]}")
  for v in "${variants[@]}"; do
    read -r name _ _ which <<<"$v"
    t=$(median "${ms[$payload,$name,tollgate]}")
    tnet=$(awk -v a="$t" -v b="$tid" 'BEGIN{printf "%.2f", a - b}')
    if [[ $which == both ]]; then
      g=$(median "${ms[$payload,$name,nginx]}")
      gnet=$(awk -v a="$g" -v b="$nid" 'BEGIN{printf "%.2f", a - b}')
      rel=$(awk -v a="$t" -v b="$g" -v c="$tnet" -v d="$gnet" 'BEGIN{ if (d > 0) printf "%.2f (%.2f)", a / b, c / d; else printf "%.2f", a / b }')
      echo "| $payload | $name | ${ratio[$payload,$name,tollgate]} | $t ($tnet) | ${ratio[$payload,$name,nginx]} | $g ($gnet) | $rel |"
    else
      echo "| $payload | $name | ${ratio[$payload,$name,tollgate]} | $t ($tnet) | — | — | — |"
    fi
  done
done
