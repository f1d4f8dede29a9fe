#!/usr/bin/env bash
# Wake-ups, syscalls and packets per request of proxies behind one nginx upstream (issue 15,
# step 2): what the kernel does for each request, which is most of a proxied request's cost.
#
#   benches/wakeups.sh                                   # nginx, tollgate, yardstick (pool, conn)
#   benches/wakeups.sh nginx target/dist/tollgate "YARD_BARE=1 target/dist/examples/yardstick"
#   ROUNDS=3 DURATION=10 benches/wakeups.sh              # defaults: ROUNDS=2 DURATION=8 (seconds)
#
# A candidate is `nginx` (configured like benches/harness/run.sh's nginx proxy: proxy_pass to the
# upstream with a `keepalive 1024` pool, HTTP/1.1 and `Connection ""` upstream, a never-
# rejecting `limit_req`) or a binary, optionally preceded by VAR=value words, run as
# `env VAR=value... BINARY bench` with the harness's UPSTREAM_ADDR / LISTEN_ADDR (tollgate
# and examples/yardstick both read them). Build first:
#   cargo build --profile dist && cargo build --profile dist --example yardstick
#
# Layout as in the harness: the upstream (benches/upstream.sh) and every candidate on core 0,
# wrk -t1 -c50 on core 1. UPSTREAM_CPUS=1 moves the upstream to wrk's core, so the proxy has
# core 0 to itself and its writes wake a peer on another core, as in production.
#
# For each round and candidate, one wrk run holds, after a 2 s warm-up (during which
# `strace -c` watches the proxy and the upstream for 1 s to learn which syscalls they make),
# two windows of DURATION seconds:
#   1. plain: CPU (utime+stime) and context switches (voluntary = went to sleep, involuntary
#      = preempted; summed over /proc/PID/task/*/status) of the proxy and of the upstream's
#      worker; TCP segments and bytes from `ss -ti` on the proxy's own sockets (client side:
#      local port = its listen port; upstream side: peer port = the upstream's), split into
#      data segments and pure ACKs. Requests = data segments the proxy received from wrk
#      (wrk sends each request as one segment and waits for the answer; the bytes row
#      checks it: 41 bytes a request).
#   2. perf: `perf stat` on the proxy and on the upstream worker, enabled and disabled through
#      its control fifo so that only the window counts: the syscalls found above, all
#      syscalls (raw_syscalls:sys_enter), epoll_wait with timeout 0 (tokio's I/O poll every
#      61 task polls; not a sleep) and epoll_wait that returned nothing, context switches,
#      sched:sched_wakeup (counted in the waker: wake-ups this process caused, same core).
#      perf costs each traced syscall and switch: throughput drops ~20 % in this window and
#      its context-switch counts run ~10 % below window 1's; read wake-ups from window 1.
# A quiet gate as in benches/harness/run.sh: each measurement waits until other processes use
# <= QUIET_MAX % (10) of a core, for up to QUIET_WAIT s (900), and is re-run (RETRIES, 3)
# when other load rose during it: a CPU hog on core 0 changes the regime (context switches
# per request fell 2-10 x in disturbed runs), so only quiet windows are comparable.
# Counts per request repeat within a few %; CPU per request is a noisy hint.
#
# Before the load: the exact bytes each candidate sends upstream and answers the client for
# wrk's request, through a Python upstream that records them and answers what nginx answers.
# After it (UPSTREAM_INSTR=0 skips it): the upstream nginx under callgrind, fed each captured
# request UPSTREAM_N (5000) times: its user-space instructions per request for those bytes.
#
# perf with syscall tracepoints is required. strace is not a fallback: attached, it slows the
# proxy 20-30 x (65k -> 2-3k req/s here), which changes how many requests each epoll_wait
# finds, and its attach/detach times cannot be lined up with the request count; it only
# names the syscalls.
#
# KEEP=dir keeps the raw snapshots, perf outputs and captures.
set -euo pipefail
# shellcheck source=benches/upstream.sh
source "$(dirname "${BASH_SOURCE[0]}")/upstream.sh"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
for t in nginx wrk taskset ss python3 perf strace; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
rounds=${ROUNDS:-2} dur=${DURATION:-8} up_cpus=${UPSTREAM_CPUS:-0}
perf stat -e 'syscalls:sys_enter_getpid' -- true >/dev/null 2>&1 ||
  { echo "perf cannot open syscall tracepoints (root? tracefs? kernel.perf_event_paranoid?)" >&2; exit 1; }
if [[ $# -eq 0 ]]; then
  set -- nginx "$root/target/dist/tollgate" "$root/target/dist/examples/yardstick" \
    "YARD_UPSTREAM=conn $root/target/dist/examples/yardstick"
fi
cands=("$@")
up_port=18390 cap_port=18389 base_port=18391
for p in $up_port $cap_port $(seq $base_port $((base_port + ${#cands[@]} - 1))); do
  if ss -tlnH "sport = :$p" | grep -q .; then echo "port $p is in use: not measuring someone else's server" >&2; exit 1; fi
done
work=$(mktemp -d /tmp/perf-wakeups.XXXXXX)
cleanup() {
  local p
  for p in $(cat "$work"/*.pid 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ -n ${KEEP:-} ]]; then mkdir -p "$KEEP" && cp -r "$work"/. "$KEEP"/; fi
  rm -rf "$work"
}
trap cleanup EXIT
label() { # a short column name for candidate $1
  local c=$1 w vars="" bin
  [[ $c == nginx ]] && { echo nginx; return; }
  for w in $c; do if [[ $w == *=* ]]; then vars+="${w#*_}," ; else bin=${w##*/}; fi; done
  [[ -n $vars ]] && echo "$bin(${vars%,})" || echo "$bin"
}

# ---- candidates --------------------------------------------------------------------------
nginx_proxy_conf() { # dir listen_port upstream_port: the harness's nginx proxy, pass scenario
  mkdir -p "$1/tmp"
  cat > "$1/proxy.conf" <<NGX
worker_processes 1; daemon on; pid $1/proxy.pid; error_log $1/proxy-error.log crit;
events { worker_connections 8192; }
http {
  access_log off; server_tokens off; keepalive_timeout 300s; keepalive_requests 1000000000;
  client_body_temp_path $1/tmp/cb; proxy_temp_path $1/tmp/px; fastcgi_temp_path $1/tmp/fc;
  uwsgi_temp_path $1/tmp/uw; scgi_temp_path $1/tmp/sc;
  limit_req_zone \$binary_remote_addr zone=pass:1m rate=100000000r/s;
  limit_req_status 429;
  upstream backend { server 127.0.0.1:$3; keepalive 1024; keepalive_requests 1000000000; keepalive_timeout 300s; }
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  server { listen 127.0.0.1:$2 backlog=4096;
    location / { limit_req zone=pass burst=100000000 nodelay; proxy_pass http://backend; } }
}
NGX
}
# start_candidate INDEX UPSTREAM_PORT LISTEN_PORT: a binary's pid goes to $work/c$INDEX.pid;
# for nginx, the master's to $work/c$INDEX-master.pid and the worker's (measured) to .worker.
start_candidate() {
  local i=$1 up=$2 port=$3 c=${cands[$1]} d
  if [[ $c == nginx ]]; then
    d=$work/nginx-c$i-$up; mkdir -p "$d"; nginx_proxy_conf "$d" "$port" "$up"
    taskset -c 0 nginx -p "$d" -c "$d/proxy.conf"
    cp "$d/proxy.pid" "$work/c$i-master.pid"
    for _ in $(seq 50); do pgrep -P "$(cat "$d/proxy.pid")" >/dev/null && break; sleep 0.1; done
    pgrep -P "$(cat "$d/proxy.pid")" | head -1 > "$work/c$i.worker"
  else
    # shellcheck disable=SC2086 # a candidate is words: VAR=value... binary
    UPSTREAM_ADDR=127.0.0.1:$up LISTEN_ADDR=127.0.0.1:$port taskset -c 0 env $c bench \
      >"$work/c$i.log" 2>&1 &
    echo $! > "$work/c$i.pid"
  fi
  for _ in $(seq 100); do ss -tlnH "sport = :$port" | grep -q . && return 0; sleep 0.1; done
  echo "candidate $c did not listen on $port (log: $(cat "$work/c$i.log" 2>/dev/null))" >&2; exit 1
}
stop_candidate() {
  local i=$1
  if [[ -f $work/c$i-master.pid ]]; then kill "$(cat "$work/c$i-master.pid")"; rm "$work/c$i-master.pid" "$work/c$i.worker"
  else kill "$(cat "$work/c$i.pid")"; wait "$(cat "$work/c$i.pid")" 2>/dev/null || true; rm "$work/c$i.pid"; fi
  sleep 0.3
}
measured_pid() { if [[ -f $work/c$1.worker ]]; then cat "$work/c$1.worker"; else cat "$work/c$1.pid"; fi; }

# ---- 1. the bytes on the wire for one request ---------------------------------------------
cat > "$work/capture.py" <<'PY'
# A keep-alive upstream that records every request head it reads and answers with the bytes
# in sys.argv[3] (what the real upstream answered), so proxies see what they see under load.
import socket, sys, threading
port, log, answer = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], "rb").read()
lock = threading.Lock()
def serve(c):
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            d = c.recv(65536)
            if not d:
                return
            buf += d
        head, buf = buf.split(b"\r\n\r\n", 1)
        with lock, open(log, "ab") as f:
            f.write(head + b"\r\n\r\n")
        c.sendall(answer)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
PY
cat > "$work/client.py" <<'PY'
# Sends wrk's request (the exact bytes wrk -t1 -c50 sends) on one connection and prints the answer.
import socket, sys
port = int(sys.argv[1])
req = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port
c = socket.create_connection(("127.0.0.1", port)); c.sendall(req)
buf = b""
while b"\r\n\r\n" not in buf:
    buf += c.recv(65536)
head, body = buf.split(b"\r\n\r\n", 1)
n = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")), 0)
while len(body) < n:
    body += c.recv(65536)
sys.stdout.buffer.write(head + b"\r\n\r\n" + body)
PY
show() { # file prefix: the head, CRLF shown, with its size and field count
  local size fields
  size=$(wc -c < "$1"); fields=$(( $(grep -c $'\r$' "$1") - 2 ))
  echo "$2 ($size bytes, $fields header fields):"
  sed -e 's/\r$/\\r/' -e 's/^/    /' "$1"
}

start_upstream "$work" $up_port "$up_cpus"
echo "$(pgrep -P "$(cat "$work/nginx.pid")" | head -1)" > "$work/upstream.worker"
upw=$(cat "$work/upstream.worker")
python3 "$work/client.py" $up_port > "$work/upstream-answer.bin"
python3 "$work/capture.py" $cap_port "$work/captured.bin" "$work/upstream-answer.bin" &
echo $! > "$work/capture.pid"
sleep 0.3
echo "=== bytes on the wire for wrk's request"
printf 'GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n' $base_port > "$work/wrk-request.bin"
show "$work/wrk-request.bin" "wrk -> proxy (Host names the proxy's port)"
show "$work/upstream-answer.bin" "upstream -> proxy"
for i in "${!cands[@]}"; do
  : > "$work/captured.bin"
  start_candidate "$i" $cap_port $((base_port + i))
  python3 "$work/client.py" $((base_port + i)) > "$work/answer-c$i.bin"
  sleep 0.2
  show "$work/captured.bin" "$(label "${cands[$i]}") -> upstream"
  show "$work/answer-c$i.bin" "$(label "${cands[$i]}") -> client"
  cp "$work/captured.bin" "$work/request-c$i.bin"
  stop_candidate "$i"
done
kill "$(cat "$work/capture.pid")"; rm "$work/capture.pid"

# ---- 2. counts under load ------------------------------------------------------------------
hz=$(getconf CLK_TCK)
# sockets PID FILTER > file: "local peer segs_out segs_in data_segs_out data_segs_in bytes_sent bytes_received"
sockets() {
  ss -tinOpH state established "$2" | awk -v pid="pid=$1," 'index($0, pid) {
    delete v
    for (i = 5; i <= NF; i++) { n = index($i, ":"); if (n) v[substr($i, 1, n - 1)] = substr($i, n + 1) }
    print $3, $4, v["segs_out"] + 0, v["segs_in"] + 0, v["data_segs_out"] + 0, v["data_segs_in"] + 0,
      v["bytes_sent"] + 0, v["bytes_received"] + 0 }'
}
# delta A B: the sum over sockets of B - A (a socket absent from A counts from 0)
delta() {
  awk 'NR == FNR { for (i = 3; i <= 8; i++) a[$1 " " $2, i] = $i; next }
       { for (i = 3; i <= 8; i++) s[i] += $i - a[$1 " " $2, i] }
       END { printf "%d %d %d %d %d %d\n", s[3], s[4], s[5], s[6], s[7], s[8] }' "$1" "$2"
}
cpu_ticks() { awk '{print $14, $15}' "/proc/$1/stat"; }
ctxt() { cat /proc/"$1"/task/*/status | awk '/^voluntary_ctxt/{v+=$2} /^nonvoluntary_ctxt/{n+=$2} END{print v, n}'; }
steal() { awk '/^cpu /{print $9}' /proc/stat; }
snap() { # pid port tag: everything the plain window reads, at one instant
  local pid=$1 port=$2 tag=$3
  sockets "$pid" "sport = :$port" > "$work/$tag.client"
  sockets "$pid" "dport = :$up_port" > "$work/$tag.upstream"
  echo "$(date +%s.%N) $(cpu_ticks "$pid") $(ctxt "$pid") $(cpu_ticks "$upw") $(ctxt "$upw") $(steal)" > "$work/$tag.proc"
}
res=$work/results.tsv
put() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$res"; }  # cand round metric value
per() { awk -v a="$1" -v n="$2" -v k="${3:-1}" 'BEGIN{ printf "%.3f", (n > 0 ? a * k / n : 0) }'; }

# perf's cost grows with the number of events on a task (every one is switched in and out at
# each context switch): all ~350 syscall tracepoints on the proxy took 18 s to attach and
# detach and cut its throughput by 3-10 x. So `strace -c` for 1 s during the warm-up finds
# which syscalls the proxy and the upstream make (it slows them only for that second), and
# the measured window counts only those, plus every syscall together (raw_syscalls) to show
# that nothing was missed.
discover() { # PID...: the syscall tracepoints to count, comma-separated
  local p f=() w=()
  for p in "$@"; do
    timeout -s INT 1 strace -c -f -q -p "$p" -o "$work/discover-$p" 2>/dev/null &
    w+=($!) f+=("$work/discover-$p")
  done
  wait "${w[@]}" || true
  { printf '%s\n' epoll_wait recvfrom sendto writev read write
    awk '$4 ~ /^[0-9]+$/ && $NF != "total" {print $NF}' "${f[@]}"
  } | sort -u | while read -r p; do
    # strace and the kernel name a few syscalls differently: count only existing tracepoints
    if [[ ! -d /sys/kernel/tracing/events/syscalls || -d /sys/kernel/tracing/events/syscalls/sys_enter_$p ]]; then
      echo "syscalls:sys_enter_$p"
    fi
  done | paste -sd,
}
# counter_start PID OUT TAG EVENTS: perf stat on PID with its events disabled until
# `counter_cmd TAG enable` (so that perf's setup is outside the window).
counter_start() {
  rm -f "$work/$3.ctl" "$work/$3.ack"; mkfifo "$work/$3.ctl" "$work/$3.ack"
  # epoll_wait twice more: the non-blocking ones (tokio polls every 61 task polls without
  # parking), and those that found nothing.
  taskset -c 1 perf stat -x, --no-big-num -e "raw_syscalls:sys_enter,context-switches,cpu-migrations,sched:sched_wakeup,$4" \
    -e syscalls:sys_enter_epoll_wait --filter 'timeout == 0' -e syscalls:sys_exit_epoll_wait --filter 'ret == 0' -D -1 \
    --control "fifo:$work/$3.ctl,$work/$3.ack" -p "$1" -o "$2" 2>/dev/null &
  echo $! > "$work/$3-counter.pid"
}
# counter_cmd TAG enable|disable: waits for perf's ack
counter_cmd() {
  local ctl ack line
  exec {ctl}>"$work/$1.ctl" {ack}<"$work/$1.ack"
  echo "$2" >&"$ctl"; read -r line <&"$ack"
  exec {ctl}>&- {ack}<&-
}
counter_stop() { # TAG: perf prints its counts on SIGINT
  local pid; pid=$(cat "$work/$1-counter.pid")
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true; rm "$work/$1-counter.pid"
}
# counts FILE: "name count" lines of a perf -x, output
counts() {
  awk -F, '$1 ~ /^[0-9]+$/ { n = $3
    if (n == "syscalls:sys_exit_epoll_wait") n = "epoll_wait-found-nothing"
    else if (n == "raw_syscalls:sys_enter") n = "all-syscalls"
    else if (seen[n]++) n = n "-timeout-0"
    sub(/^syscalls:sys_enter_/, "", n); sub(/^sched:/, "", n); if ($1 > 0) print n, $1 }' "$1"
}

# ---- the quiet gate and the load that is not ours ------------------------------------------
# Other sessions build and fuzz on these two cores. A CPU hog on core 0 changes the regime
# (the proxy finds more requests per wake-up, so fewer wake-ups and syscalls per request), so
# a measurement waits for a quiet machine and is re-run when other load rose during it.
quiet_max=${QUIET_MAX:-10} quiet_wait=${QUIET_WAIT:-900} retries=${RETRIES:-3}
# busy PIDS...: "seconds busy_all_cpus ours" in ticks (user+nice+system of the machine; the
# listed processes, the upstream worker and the counters are ours)
busy() {
  local ours=0 p
  for p in "$@" "$upw" $(cat "$work"/*-counter.pid 2>/dev/null); do
    if [[ -r /proc/$p/stat ]]; then ours=$((ours + $(awk '{print $14 + $15}' "/proc/$p/stat"))); fi
  done
  echo "$(date +%s.%N) $(awk '/^cpu /{print $2 + $3 + $4}' /proc/stat) $ours"
}
other() { # busy_a busy_b: other processes' CPU in % of one core (softirq left out: ours, mostly)
  awk -v a="$1" -v b="$2" -v hz="$hz" 'BEGIN{ split(a, x, " "); split(b, y, " ")
    o = 100 * ((y[2] - x[2]) - (y[3] - x[3])) / hz / (y[1] - x[1]); printf "%.0f", (o < 0 ? 0 : o) }'
}
wait_quiet() { # returns the idle machine's other load, after waiting up to quiet_wait seconds
  local start=$SECONDS a b o
  while :; do
    a=$(busy); sleep 1; b=$(busy); o=$(other "$a" "$b")
    if ((o <= quiet_max || SECONDS - start >= quiet_wait)); then echo "$o"; return; fi
    sleep 4
  done
}
# measure I R: one wrk run with both windows; rows go to $work/attempt.tsv
measure() {
  local i=$1 r=$2 res=$work/attempt.tsv
  local c port pid wrk_pid busy_a busy_b n n2 secs t0 t1 name count events
  local pu0 ps0 pv0 pn0 uu0 us0 uv0 un0 st0 pu1 ps1 pv1 pn1 uu1 us1 uv1 un1 st1
  local cso csi cdo cdi cbo cbi uso usi udo udi ubo ubi
  c=$(label "${cands[$i]}") port=$((base_port + i)) pid=$(measured_pid "$i")
  : > "$res"
    taskset -c 1 wrk -t1 -c50 -d$((2 * dur + 7))s "http://127.0.0.1:$port/" > "$work/wrk-$i-$r.out" &
    wrk_pid=$!; echo "$wrk_pid" > "$work/wrk.pid"
    sleep 1
    events=$(discover "$pid" "$upw")
    sleep 1
    # window 1: plain
    busy_a=$(busy "$pid" "$wrk_pid"); snap "$pid" "$port" a; sleep "$dur"; snap "$pid" "$port" b; busy_b=$(busy "$pid" "$wrk_pid")
    put "$c" "$r" "other load, % of a core (window 1)" "$(other "$busy_a" "$busy_b")"
    read -r t0 pu0 ps0 pv0 pn0 uu0 us0 uv0 un0 st0 < "$work/a.proc"
    read -r t1 pu1 ps1 pv1 pn1 uu1 us1 uv1 un1 st1 < "$work/b.proc"
    read -r cso csi cdo cdi cbo cbi < <(delta "$work/a.client" "$work/b.client")
    read -r uso usi udo udi ubo ubi < <(delta "$work/a.upstream" "$work/b.upstream")
    n=$cdi secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b - a}')
    put "$c" "$r" "requests/s" "$(awk -v n="$n" -v s="$secs" 'BEGIN{printf "%.0f", n / s}')"
    put "$c" "$r" "bytes wrk->proxy per req (41 = one wrk request)" "$(per "$cbi" "$n")"
    put "$c" "$r" "proxy CPU us/req (noisy)" "$(per $((pu1 + ps1 - pu0 - ps0)) "$n" $((1000000 / hz)))"
    put "$c" "$r" "  user us/req (noisy)" "$(per $((pu1 - pu0)) "$n" $((1000000 / hz)))"
    put "$c" "$r" "  system us/req (noisy)" "$(per $((ps1 - ps0)) "$n" $((1000000 / hz)))"
    put "$c" "$r" "upstream CPU us/req (noisy)" "$(per $((uu1 + us1 - uu0 - us0)) "$n" $((1000000 / hz)))"
    put "$c" "$r" "steal, % of a core (window)" "$(awk -v d=$((st1 - st0)) -v s="$secs" -v hz="$hz" 'BEGIN{printf "%.1f", 100 * d / hz / s}')"
    put "$c" "$r" "proxy voluntary cs/req" "$(per $((pv1 - pv0)) "$n")"
    put "$c" "$r" "proxy involuntary cs/req" "$(per $((pn1 - pn0)) "$n")"
    put "$c" "$r" "upstream voluntary cs/req" "$(per $((uv1 - uv0)) "$n")"
    put "$c" "$r" "upstream involuntary cs/req" "$(per $((un1 - un0)) "$n")"
    put "$c" "$r" "  requests the upstream serves per wake-up" "$(per "$n" $((uv1 - uv0)))"
    put "$c" "$r" "client side: packets/req" "$(per $((cso + csi)) "$n")"
    put "$c" "$r" "  data segments from wrk, per req" "$(per "$cdi" "$n")"
    put "$c" "$r" "  data segments to wrk, per req" "$(per "$cdo" "$n")"
    put "$c" "$r" "  pure ACKs, client side, per req" "$(per $((csi - cdi + cso - cdo)) "$n")"
    put "$c" "$r" "  bytes proxy->wrk per req" "$(per "$cbo" "$n")"
    put "$c" "$r" "upstream side: packets/req" "$(per $((uso + usi)) "$n")"
    put "$c" "$r" "  data segments to upstream, per req" "$(per "$udo" "$n")"
    put "$c" "$r" "  data segments from upstream, per req" "$(per "$udi" "$n")"
    put "$c" "$r" "  pure ACKs, upstream side, per req" "$(per $((uso - udo + usi - udi)) "$n")"
    put "$c" "$r" "  bytes proxy->upstream per req" "$(per "$ubo" "$n")"
    put "$c" "$r" "  upstream connections used" "$(wc -l < "$work/b.upstream")"
    sleep 1
    # window 2: perf stat on the proxy and on the upstream worker
    busy_a=$(busy "$pid" "$wrk_pid")
    counter_start "$pid" "$work/perf-proxy-$i-$r" p "$events"
    counter_start "$upw" "$work/perf-upstream-$i-$r" u "$events"
    counter_cmd p enable; counter_cmd u enable
    sockets "$pid" "sport = :$port" > "$work/p.a"; t0=$(date +%s.%N)
    sleep "$dur"
    sockets "$pid" "sport = :$port" > "$work/p.b"; t1=$(date +%s.%N)
    counter_cmd p disable; counter_cmd u disable
    counter_stop p; counter_stop u
    busy_b=$(busy "$pid" "$wrk_pid")
    put "$c" "$r" "other load, % of a core (window 2)" "$(other "$busy_a" "$busy_b")"
    read -r _ _ _ n2 _ _ < <(delta "$work/p.a" "$work/p.b")
    put "$c" "$r" "(perf window) requests/s" "$(awk -v n="$n2" -v a="$t0" -v b="$t1" 'BEGIN{printf "%.0f", n / (b - a)}')"
    while read -r name count; do put "$c" "$r" "proxy $name/req" "$(per "$count" "$n2")"; done < <(counts "$work/perf-proxy-$i-$r")
    while read -r name count; do put "$c" "$r" "upstream $name/req" "$(per "$count" "$n2")"; done < <(counts "$work/perf-upstream-$i-$r")
    wait "$wrk_pid" || true; rm "$work/wrk.pid"
}

for i in "${!cands[@]}"; do start_candidate "$i" $up_port $((base_port + i)); done
echo "=== under load: wrk -t1 -c50 on core 1, proxy on core 0, upstream on core $up_cpus, ${dur}s windows, $rounds rounds"
echo "    (quiet gate: other load <= ${quiet_max}% of a core, waiting up to ${quiet_wait}s; $retries retries)"
: > "$res"
for r in $(seq "$rounds"); do
  for i in "${!cands[@]}"; do
    c=$(label "${cands[$i]}")
    for attempt in $(seq $((retries + 1))); do
      idle=$(wait_quiet)
      measure "$i" "$r"
      worst=$(awk -F'\t' '$3 ~ /^other load/ && $4 > m {m = $4} END{print m + 0}' "$work/attempt.tsv")
      rps=$(awk -F'\t' '$3 == "requests/s" {print $4}' "$work/attempt.tsv")
      printf 'round %d  %-34s %6s req/s  other load %3s%% (idle before: %s%%)%s\n' "$r" "$c" "$rps" "$worst" "$idle" \
        "$( ((worst > quiet_max)) && echo "  DISTURBED$( ((attempt <= retries)) && echo ', again')")"
      if ((worst <= quiet_max || attempt > retries)); then break; fi
    done
    if ((worst > quiet_max)); then printf '%s\t%s\t%s\t%s\n' "$c" "$r" "DISTURBED (other load > ${quiet_max}%)" yes >> "$res"; fi
    cat "$work/attempt.tsv" >> "$res"
    cp "$res" "$work/results.partial"
  done
done

# ---- table: one row per metric, one column per candidate, rounds as r1 / r2 / ... ----------
labels=(); for c in "${cands[@]}"; do labels+=("$(label "$c")"); done
printf '| per request (rounds: r1 / r2 ...) |'; printf ' %s |' "${labels[@]}"; echo
printf '|---|'; printf -- '---|%.0s' "${labels[@]}"; echo
awk -F'\t' -v labels="$(IFS='|'; echo "${labels[*]}")" -v rounds="$rounds" '
  BEGIN { nc = split(labels, L, "|") }
  { if (!($3 in seen)) { seen[$3] = ++nk; order[nk] = $3 } v[$3, $1, $2] = $4 }
  END {
    for (k = 1; k <= nk; k++) {
      key = order[k]; grp = 1
      if (key ~ /^proxy [a-z_0-9-]+\/req$/) grp = 2; else if (key ~ /^upstream [a-z_0-9-]+\/req$/) grp = 3
      big = grp == 1
      line = "| " key " |"
      for (i = 1; i <= nc; i++) {
        cell = ""
        for (r = 1; r <= rounds; r++) {
          x = v[key, L[i], r]; if (x == "") x = (grp == 1 ? "-" : "0")
          if (grp > 1 && x + 0 >= 0.01) big = 1
          cell = cell (r > 1 ? " / " : "") x
        }
        line = line " " cell " |"
      }
      # syscalls and events only when some candidate makes at least 0.01 a request
      if (big) printf "%d\t%s\t%s\n", grp, (grp == 1 ? sprintf("%04d", k) : key), line
    }
  }' "$res" | sort -t$'\t' -k1,1n -k2,2 | cut -f3-
echo "(perf: syscalls counted at sys_enter; sched_wakeup counted in the waker; CPU figures are /proc ticks, noisy on this shared machine)"

# ---- 3. what the request bytes cost the upstream ---------------------------------------------
# The upstream nginx under callgrind (one process, no master), fed each candidate's captured
# request over one keep-alive connection: user-space instructions per request, exact, for the
# header fields each proxy adds (the kernel side of ~100 more bytes is a longer copy only).
upstream_instr() {
  local d=$work/ucg port=$cap_port n=${UPSTREAM_N:-5000} vpid f ir
  mkdir -p "$d"
  cat > "$d/nginx.conf" <<NGX
worker_processes 1; daemon off; master_process off; pid $d/nginx.pid; error_log $d/error.log crit;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000000;
  server { listen 127.0.0.1:$port; location / { return 200 "ok\n"; } } }
NGX
  cat > "$work/replay.py" <<'PY'
# Sends the request in argv[3] argv[2] times on one keep-alive connection, one at a time.
import socket, sys
port, n, req = int(sys.argv[1]), int(sys.argv[2]), open(sys.argv[3], "rb").read()
c = socket.create_connection(("127.0.0.1", port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = b""
for _ in range(n):
    c.sendall(req)
    while b"\r\n\r\nok\n" not in buf:
        buf += c.recv(65536)
    buf = buf.split(b"\r\n\r\nok\n", 1)[1]
PY
  taskset -c 0 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$d/cg.out" \
    nginx -p "$d" -c "$d/nginx.conf" 2>"$d/vg.log" &
  for _ in $(seq 100); do ss -tlnH "sport = :$port" | grep -q . && break; sleep 0.2; done
  vpid=$(pgrep -f "callgrind-out-file=$d/cg.out" | head -1); echo "$vpid" > "$work/ucg.pid"
  echo "=== upstream nginx: user-space instructions per request (callgrind, $n requests on one connection)"
  for f in "$work/wrk-request.bin" "$work"/request-c*.bin; do
    python3 "$work/replay.py" "$port" 500 "$f"
    callgrind_control -z "$vpid" >/dev/null 2>&1; callgrind_control -i on "$vpid" >/dev/null 2>&1
    python3 "$work/replay.py" "$port" "$n" "$f"
    callgrind_control -i off "$vpid" >/dev/null 2>&1; callgrind_control -d "$vpid" >/dev/null 2>&1
    ir=$(cat "$d"/cg.out.* | awk '/^totals:/{s += $2} END{print s + 0}'); rm -f "$d"/cg.out.*
    case $f in
      */wrk-request.bin) name="wrk's own request, direct" ;;
      *) i=${f##*request-c}; i=${i%.bin}; name="$(label "${cands[$i]}")'s request" ;;
    esac
    printf '  %-40s %4d bytes %2d fields %8.0f instructions/request\n' "$name" "$(wc -c < "$f")" \
      $(( $(grep -c $'\r$' "$f") - 2 )) "$(awk -v i="$ir" -v n="$n" 'BEGIN{print i / n}')"
  done
  kill "$vpid"; wait "$vpid" 2>/dev/null || true; rm "$work/ucg.pid"
}
if [[ ${UPSTREAM_INSTR:-1} == 1 ]] && command -v valgrind >/dev/null && command -v callgrind_control >/dev/null; then
  upstream_instr
fi
