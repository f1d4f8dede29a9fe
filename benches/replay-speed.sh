#!/usr/bin/env bash
# Lines a second `tollgate replay` reads, decides and reports, on one core, for tollgate's own
# JSON access log (the format it reads fastest and the one the target is for: 500,000 a second).
#
#   benches/replay-speed.sh target/dist/tollgate          # N=1000000 lines, 2,000 clients
#
# The log is made up front (not timed): lines as `log: { format: json, access: true,
# access_keys: true }` writes them, 2,000 client addresses, 200 requests a second of log
# time, a route with two limits (a token bucket per client, a sliding window per route and
# path). `taskset -c 0` keeps the run on one core; the figure is lines / wall time.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 BINARY" >&2; exit 2; }
bin=$1 n=${N:-1000000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/candidate.yaml" <<'YAML'
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    upstream: app
    limits:
      - { name: per-client, algorithm: token_bucket, rate: 2/s, burst: 5, key: client_ip }
      - { name: per-path, algorithm: sliding_window, rate: 1/s, key: [route, path] }
YAML
python3 - "$n" >"$work/access.log" <<'PY'
import sys
n = int(sys.argv[1])
t0 = 1796547235000000
w = sys.stdout.write
for i in range(n):
    us = t0 + i * 5000
    s, f = divmod(us, 1000000)
    ts = "2026-12-06T08:%02d:%02d.%06dZ" % ((s // 60) % 60, s % 60, f)
    ip = "10.%d.%d.%d" % (i % 7, (i * 31) % 250, (i * 17) % 40 + 1)
    w('{"timestamp":"%s","level":"INFO","fields":{"route":"api","peer":"%s","method":"GET",'
      '"host":"api.example","path":"/items/%d","query":"page=%d","status":200,"duration_ms":0.41,'
      '"remaining":3,"delayed_ms":0.0,"stale":"no","request_id":"%032x","at_us":%d,'
      '"keys":"per-client|client_ip|%032x;per-path|route,path|%032x"},"target":"tollgate::access"}\n'
      % (ts, ip, i % 100, i % 7, i, us, i * 7919, i % 100))
PY
lines=$(wc -l <"$work/access.log")
start=$(date +%s.%N)
taskset -c 0 "$bin" replay -c "$work/candidate.yaml" "$work/access.log" --json >"$work/report.json"
end=$(date +%s.%N)
python3 - "$lines" "$start" "$end" "$work/report.json" <<'PY'
import json, sys
lines, start, end = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
r = json.load(open(sys.argv[4]))
took = end - start
print(f"{lines} lines in {took:.2f} s: {lines / took:,.0f} lines/s on one core "
      f"({r['lines']['requests']} requests, {r['routes'][0]['throttled']} would get 429)")
PY
