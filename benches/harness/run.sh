#!/usr/bin/env bash
# Reverse-proxy benchmark harness: direct upstream vs nginx vs HAProxy vs an optional candidate.
# Usage and meaning of every number: see benchmarks/harness.md. benches/load.sh runs it with
# tollgate as the candidate.
#
#   benches/harness/run.sh                         # baseline (direct, nginx, haproxy)
#   CANDIDATE_CMD='./target/dist/tollgate bench' CANDIDATE_PORT=18020 benches/harness/run.sh
#   ... CANDIDATE2_CMD=... CANDIDATE2_PORT=18030 ...  # a second candidate in the same rounds
#
# Everything runs on 127.0.0.1 only. All processes are started by this script with their own
# config + pid files under $WORK_DIR and are stopped by PID (trap on EXIT/INT/TERM).
set -uo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,/^set -uo/p' "$0" | sed '$d'; echo "knobs (env): see the 'knobs' section of $0 and benchmarks/harness.md"; exit 0; fi

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=benches/upstream.sh
source "$BENCH_DIR/../upstream.sh"

# ----------------------------------------------------------------------------------- knobs
WORK_DIR=${WORK_DIR:-/tmp/proxy-bench}
DURATION=${DURATION:-10s}           # wrk -d
WARMUP=${WARMUP:-2s}                # one unrecorded wrk run per target before round 1
THREADS=${THREADS:-1}               # wrk -t
CONNS=${CONNS:-50}                  # wrk -c  (also h2load -c)
ROUNDS=${ROUNDS:-3}                 # interleaved rounds: A B C A B C ...
SCENARIOS=${SCENARIOS:-"pass reject h2"}
H2_REQUESTS=${H2_REQUESTS:-200000}  # h2load -n
H2_STREAMS=${H2_STREAMS:-10}        # h2load -m
PIN=${PIN:-1}                       # 1 = use taskset, 0 = let the scheduler place everything
SERVER_CPUS=${SERVER_CPUS:-0}       # proxy under test
UPSTREAM_CPUS=${UPSTREAM_CPUS:-0}   # upstream nginx (default: shares core 0 with the proxy)
CLIENT_CPUS=${CLIENT_CPUS:-1}       # wrk / h2load
QUIET_MAX=${QUIET_MAX:-10}          # foreign CPU (% of one core) tolerated before/while measuring
QUIET_WAIT=${QUIET_WAIT:-180}       # max seconds to wait for the machine to become quiet
STEAL_MAX=${STEAL_MAX:-5}           # hypervisor steal (% of one core, summed over cores) tolerated while measuring
RETRIES=${RETRIES:-3}               # re-runs of a measurement disturbed by foreign load or steal
NGINX_ERROR_LOG_LEVEL=${NGINX_ERROR_LOG_LEVEL:-crit}  # 'error' would log every limit_req rejection

# ports (all 127.0.0.1)
P_UP=18000 P_UP_H2=18007 P_UP_STATUS=18010
P_NGX=18001 P_NGX_H2=18003 P_NGX_REJ=18004
P_HAP=18002 P_HAP_REJ=18005 P_HAP_H2=18006

# optional candidate proxy
CANDIDATE_NAME=${CANDIDATE_NAME:-candidate}
CANDIDATE_CMD=${CANDIDATE_CMD:-}
CANDIDATE_PORT=${CANDIDATE_PORT:-}
CANDIDATE_REJECT_CMD=${CANDIDATE_REJECT_CMD:-}   # optional 2nd process for the reject scenario
CANDIDATE_REJECT_PORT=${CANDIDATE_REJECT_PORT:-} # reject-mode listener (served by either cmd)
CANDIDATE_H2_PORT=${CANDIDATE_H2_PORT:-}         # h2c (prior knowledge) listener, if any

# optional second candidate, measured in the same interleaved rounds (off unless CANDIDATE2_CMD
# is set); same contract as the first, one process serving all its listeners
CANDIDATE2_NAME=${CANDIDATE2_NAME:-candidate2}
CANDIDATE2_CMD=${CANDIDATE2_CMD:-}
CANDIDATE2_PORT=${CANDIDATE2_PORT:-}
CANDIDATE2_REJECT_PORT=${CANDIDATE2_REJECT_PORT:-}
CANDIDATE2_H2_PORT=${CANDIDATE2_H2_PORT:-}

NGINX=${NGINX:-/usr/sbin/nginx}
HAPROXY=${HAPROXY:-/usr/sbin/haproxy}
HZ=$(getconf CLK_TCK)

RUN_ID=$(date +%Y%m%d-%H%M%S)
OUT=$WORK_DIR/results/$RUN_ID
CONF=$WORK_DIR/conf
LOGS=$WORK_DIR/logs
RAW=$OUT/raw
mkdir -p "$CONF" "$LOGS" "$RAW" "$WORK_DIR/tmp" "$WORK_DIR/run"
TSV=$OUT/results.tsv

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
pin() { local cpus=$1; shift; if [[ $PIN == 1 ]]; then taskset -c "$cpus" "$@"; else "$@"; fi; }

for t in "$NGINX" "$HAPROXY" wrk curl taskset python3 ss; do
  command -v "$t" >/dev/null || die "missing tool: $t"
done
[[ " $SCENARIOS " == *" h2 "* ]] && ! command -v h2load >/dev/null && die "missing h2load (nghttp2-client)"
if [[ -n $CANDIDATE_CMD && -z $CANDIDATE_PORT ]] || [[ -z $CANDIDATE_CMD && -n $CANDIDATE_PORT ]]; then
  die "set both CANDIDATE_CMD and CANDIDATE_PORT (or neither)"
fi
if [[ -n $CANDIDATE2_CMD && -z $CANDIDATE2_PORT ]] || [[ -z $CANDIDATE2_CMD && -n $CANDIDATE2_PORT ]]; then
  die "set both CANDIDATE2_CMD and CANDIDATE2_PORT (or neither)"
fi
[[ -n $CANDIDATE2_CMD && -n $CANDIDATE_CMD && $CANDIDATE2_NAME == "$CANDIDATE_NAME" ]] && \
  die "CANDIDATE_NAME and CANDIDATE2_NAME must differ (they label the rows)"

# ------------------------------------------------------------------------ process control
declare -A PIDFILE=()   # name -> pid file of a daemon we started (nginx/haproxy)
declare -A PGID=()      # name -> process group we started (candidate)
declare -A UNITS=()     # target -> space separated "unit" names whose CPU is charged to it

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  log "stopping everything this run started"
  local name pid
  for name in "${!PGID[@]}"; do
    pid=${PGID[$name]}
    kill -TERM -- "-$pid" 2>/dev/null
  done
  for name in "${!PIDFILE[@]}"; do
    pid=$(cat "${PIDFILE[$name]}" 2>/dev/null) || continue
    [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null
  done
  local deadline=$((SECONDS + 10))
  for name in "${!PIDFILE[@]}" "${!PGID[@]}"; do
    if [[ -n ${PGID[$name]:-} ]]; then pid=${PGID[$name]}; else pid=$(cat "${PIDFILE[$name]}" 2>/dev/null) || continue; fi
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "  $name ($pid) ignored SIGTERM, sending SIGKILL"
      if [[ -n ${PGID[$name]:-} ]]; then kill -KILL -- "-$pid" 2>/dev/null; else kill -KILL "$pid" 2>/dev/null; fi
    fi
  done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_busy() { [[ -n $(ss -Hltn "sport = :$1" 2>/dev/null) ]]; }
wait_port() {  # wait until something answers HTTP on the port
  local port=$1 i
  for i in $(seq 1 300); do
    curl -s -o /dev/null -m 1 "http://127.0.0.1:$port/" && return 0
    sleep 0.1
  done
  return 1
}

# pids of a "unit": a daemon (pid file -> master + its children) or a process group
unit_pids() {
  local name=$1 pid
  if [[ -n ${PGID[$name]:-} ]]; then
    pgrep -g "${PGID[$name]}"
  else
    pid=$(cat "${PIDFILE[$name]}" 2>/dev/null) || return 0
    echo "$pid"; pgrep -P "$pid"
  fi
}
# utime+stime (clock ticks) summed over the processes of some units
unit_ticks() {
  local sum=0 name pid s
  for name in "$@"; do
    for pid in $(unit_pids "$name"); do
      s=$(< "/proc/$pid/stat") 2>/dev/null || continue
      s=${s##*) }
      # shellcheck disable=SC2086
      set -- $s
      sum=$((sum + ${12} + ${13}))
    done
  done
  echo "$sum"
}
# "busy idle steal" ticks per core, one line per core: cpuN busy idle steal
core_ticks() { awk '/^cpu[0-9]+ /{print $1, $2+$3+$4+$7+$8, $5+$6, $9}' /proc/stat; }
tcp_active_opens() { awk '/^Tcp:/{ if (!h) {for(i=1;i<=NF;i++) if($i=="ActiveOpens") c=i; h=1} else print $c }' /proc/net/snmp; }
upstream_counters() {  # "accepts requests" of the upstream nginx
  curl -s -m 2 "http://127.0.0.1:$P_UP_STATUS/" | awk 'NR==3{print $1, $3}'
}

# ------------------------------------------------------------------------------- configs
write_configs() {
  local tmp=$WORK_DIR/tmp
  local temps="client_body_temp_path $tmp/cb; proxy_temp_path $tmp/px; fastcgi_temp_path $tmp/fc; uwsgi_temp_path $tmp/uw; scgi_temp_path $tmp/sc;"

  cat > "$CONF/upstream.conf" <<NGX
# upstream: fixed tiny 200 ('ok\\n'), 1 worker, keep-alive, no logging
worker_processes 1;
pid $WORK_DIR/run/upstream.pid;
error_log $LOGS/upstream-error.log $NGINX_ERROR_LOG_LEVEL;
events { worker_connections 8192; }
http {
    access_log off;
    server_tokens off;
    default_type text/plain;
    keepalive_timeout 300s;
    keepalive_requests 1000000000;   # nginx default (1000) closes every keep-alive conn after 1000 req
    $temps
    server {
        listen 127.0.0.1:$P_UP backlog=4096;
        listen 127.0.0.1:$P_UP_H2 http2 backlog=4096;
        location / { return 200 "ok\n"; }
    }
    server {   # counters used by the harness (accepted conns, requests) - not on the measured port
        listen 127.0.0.1:$P_UP_STATUS;
        location / { stub_status; }
    }
}
NGX

  cat > "$CONF/nginx-proxy.conf" <<NGX
# nginx reverse proxy under test: 1 worker, upstream keep-alive pool, limit_req on the path
worker_processes 1;
pid $WORK_DIR/run/nginx-proxy.pid;
# limit_req logs each rejection at 'error' (delays one level lower); 'crit' keeps that I/O off the path
error_log $LOGS/nginx-proxy-error.log $NGINX_ERROR_LOG_LEVEL;
events { worker_connections 8192; }
http {
    access_log off;
    server_tokens off;
    keepalive_timeout 300s;
    keepalive_requests 1000000000;
    $temps

    # pass: rate far above any offered load. burst is needed too: without it nginx rejects the 2nd
    # request that arrives within the same millisecond, whatever the rate.
    limit_req_zone \$binary_remote_addr zone=pass:1m   rate=100000000r/s;
    limit_req_zone \$binary_remote_addr zone=reject:1m rate=1000r/s;
    limit_req_status 429;

    upstream backend {
        server 127.0.0.1:$P_UP;
        keepalive 1024;                # idle pool >= max in-flight (h2: 50 conns x 10 streams = 500),
                                       # otherwise nginx closes+reopens upstream conns continuously
        keepalive_requests 1000000000;
        keepalive_timeout 300s;
    }
    proxy_http_version 1.1;
    proxy_set_header Connection "";

    server {   # scenario "pass" (HTTP/1.1) and "h2" (h2c prior knowledge)
        listen 127.0.0.1:$P_NGX backlog=4096;
        listen 127.0.0.1:$P_NGX_H2 http2 backlog=4096;
        location / {
            limit_req zone=pass burst=100000000 nodelay;
            proxy_pass http://backend;
        }
    }
    server {   # scenario "reject"
        listen 127.0.0.1:$P_NGX_REJ backlog=4096;
        location / {
            limit_req zone=reject burst=100 nodelay;
            proxy_pass http://backend;
        }
    }
}
NGX

  # HAProxy under test: 1 thread, stick-table rate limit on the path, no logging (no 'log'
  # lines); the reject scenario admits ~1000 req/s (sliding 1 s window), the rest get 429.
  haproxy_proxy_conf "$CONF/haproxy.cfg" "$P_UP" "$P_HAP" "$P_HAP_REJ" 1000 "$P_HAP_H2"
}

# ------------------------------------------------------------------------------- startup
start_nginx() {  # name conf cpus
  local name=$1 conf=$2 cpus=$3
  PIDFILE[$name]=$WORK_DIR/run/$name.pid
  "$NGINX" -t -q -p "$WORK_DIR" -e "$LOGS/$name-error.log" -c "$conf" || die "nginx config test failed: $conf"
  pin "$cpus" "$NGINX" -p "$WORK_DIR" -e "$LOGS/$name-error.log" -c "$conf" || die "cannot start $name"
}
start_haproxy() {
  local name=haproxy cpus=$1
  PIDFILE[$name]=$WORK_DIR/run/haproxy.pid
  "$HAPROXY" -c -q -f "$CONF/haproxy.cfg" || die "haproxy config check failed"
  pin "$cpus" "$HAPROXY" -D -f "$CONF/haproxy.cfg" -p "$WORK_DIR/run/haproxy.pid" \
    >"$LOGS/haproxy.log" 2>&1 || die "cannot start haproxy (see $LOGS/haproxy.log)"
}
start_candidate() {  # name cmd port reject_port h2_port
  local name=$1 cmd=$2 port=$3 rej_port=$4 h2_port=$5 pid
  # Own process group so that the whole tree can be stopped by its id.
  # The candidate gets its addresses through the environment (use them or ignore them).
  UPSTREAM_ADDR=127.0.0.1:$P_UP LISTEN_ADDR=127.0.0.1:$port \
  LISTEN_PORT=$port REJECT_PORT=$rej_port H2_PORT=$h2_port \
  REJECT_RATE=1000 REJECT_BURST=100 \
    setsid bash -c "exec $( [[ $PIN == 1 ]] && echo "taskset -c $SERVER_CPUS" ) bash -c \"\$0\"" "$cmd" \
    >"$LOGS/$name.log" 2>&1 </dev/null &
  pid=$!
  PGID[$name]=$pid
  echo "$pid" > "$WORK_DIR/run/$name.pgid"
}

# ------------------------------------------------------------------------ quiet machine gate
# Foreign load (anything not started by this run) makes results meaningless on 2 cores.
idle_busy_pct() {  # busy % (of one core, summed over cores) over ~1s while our servers are idle
  local a b
  a=$(core_ticks | awk '{b+=$2; t+=$2+$3+$4} END{print b, t}')
  sleep 1
  b=$(core_ticks | awk '{b+=$2; t+=$2+$3+$4} END{print b, t}')
  awk -v a="$a" -v b="$b" -v n="$(nproc)" 'BEGIN{split(a,x," "); split(b,y," "); dt=y[2]-x[2]; if (dt<=0) {print 0; exit} printf "%.0f", 100*n*(y[1]-x[1])/dt}'
}
wait_quiet() {
  local start=$SECONDS busy
  while :; do
    busy=$(idle_busy_pct)
    ((busy <= QUIET_MAX)) && return 0
    if ((SECONDS - start >= QUIET_WAIT)); then
      log "  WARNING: machine still busy (${busy}% of a core used by others) after ${QUIET_WAIT}s; measuring anyway"
      return 1
    fi
    log "  machine busy (${busy}% of a core used by other processes) - waiting"
    sleep 4
  done
}

# ---------------------------------------------------------------------------- measurement
to_us() {  # wrk/h2load duration string -> microseconds
  awk -v v="$1" 'BEGIN{ n=v+0; if (v ~ /us$/) f=1; else if (v ~ /ms$/) f=1000; else if (v ~ /s$/) f=1000000; else f=1; printf "%.1f", n*f }'
}

# measure SCENARIO TARGET ROUND URL TOOL   (TOOL = wrk | h2load)
# appends one row to $TSV
measure() {
  local scen=$1 target=$2 round=$3 url=$4 tool=$5
  local attempt=0 quiet
  local units=${UNITS[$target]} up_units=upstream
  [[ $target == direct ]] && up_units=""
  while :; do
    quiet=1; wait_quiet || quiet=0
    local raw=$RAW/$scen-$target-r$round-a$attempt.txt
    local c0 c1 px0 px1 up0 up1 ao0 ao1 uc0 uc1 t0 t1 lg
    uc0=$(upstream_counters); ao0=$(tcp_active_opens)
    c0=$(core_ticks); px0=$(unit_ticks $units); up0=$(unit_ticks $up_units); t0=$(date +%s.%N)
    if [[ $tool == wrk ]]; then
      lg=$( { TIMEFORMAT='%3U %3S'; time pin "$CLIENT_CPUS" wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" --latency "$url" >"$raw" 2>&1; } 2>&1 )
    else
      lg=$( { TIMEFORMAT='%3U %3S'; time pin "$CLIENT_CPUS" h2load -t1 -n"$H2_REQUESTS" -c"$CONNS" -m"$H2_STREAMS" "$url" >"$raw" 2>&1; } 2>&1 )
    fi
    t1=$(date +%s.%N); c1=$(core_ticks); px1=$(unit_ticks $units); up1=$(unit_ticks $up_units)
    ao1=$(tcp_active_opens); uc1=$(upstream_counters)

    # ---- parse the load generator output
    local rps p50 p99 reqs non2xx errs
    if [[ $tool == wrk ]]; then
      rps=$(awk '/^Requests\/sec:/{print $2}' "$raw")
      p50=$(to_us "$(awk '$1=="50%"{print $2}' "$raw")")
      p99=$(to_us "$(awk '$1=="99%"{print $2}' "$raw")")
      reqs=$(awk '/requests in/{print $1}' "$raw")
      non2xx=$(awk '/Non-2xx or 3xx responses:/{print $NF}' "$raw"); non2xx=${non2xx:-0}
      errs=$(awk -F'[ ,]+' '/Socket errors:/{print $4+$6+$8+$10}' "$raw"); errs=${errs:-0}
    else
      rps=$(awk '/^finished in/{print $4}' "$raw")
      p50=$(to_us "$(awk '/^time for request:/{print $6}' "$raw")")   # h2load has no percentiles: mean
      p99=$(to_us "$(awk '/^time for request:/{print $5}' "$raw")")   # ... and max
      reqs=$(awk '/^requests:/{print $8}' "$raw")                      # succeeded
      non2xx=$(awk '/^status codes:/{print $5+$7+$9}' "$raw")
      errs=$(awk '/^requests:/{print $10+$12+$14}' "$raw")               # failed+errored+timeout
    fi
    if [[ -z $rps || -z $reqs || $reqs == 0 ]]; then
      log "  $scen/$target round $round: no result, load generator output:"; sed 's/^/    /' "$raw" >&2
      rps=0 reqs=0 p50=0 p99=0
    fi

    # ---- resource accounting
    local row
    row=$(awk -v c0="$c0" -v c1="$c1" -v px="$((px1 - px0))" -v up="$((up1 - up0))" -v lg="$lg" \
              -v t0="$t0" -v t1="$t1" -v hz="$HZ" -v reqs="$reqs" -v scpu="$SERVER_CPUS" -v ccpu="$CLIENT_CPUS" \
              -v ao="$((ao1 - ao0))" -v uc0="$uc0" -v uc1="$uc1" 'BEGIN{
        n=split(c0, a, "\n"); split(c1, b, "\n"); busy=0; tot=0
        for (i=1;i<=n;i++) { split(a[i], x, " "); split(b[i], y, " ");
          bz=y[2]-x[2]; id=y[3]-x[3]; st=y[4]-x[4]; t=bz+id+st; busy+=bz
          pct[x[1]] = (t>0) ? 100*bz/t : 0; stl[x[1]] = (t>0) ? 100*st/t : 0; steal+=st; tot+=t }
        el=t1-t0; split(lg, l, " "); lgt=(l[1]+l[2])*hz
        other=busy - px - up - lgt
        split(uc0, u0, " "); split(uc1, u1, " ")
        ups_conns=u1[1]-u0[1]-1; ups_reqs=u1[2]-u0[2]-1
        printf "%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%d\t%d\t%d",
          (reqs>0)? px*1e6/hz/reqs : 0, (reqs>0 && up>0)? up*1e6/hz/reqs : 0,
          100*px/hz/el, 100*lgt/hz/el, pct["cpu" scpu], pct["cpu" ccpu], 100*other/hz/el,
          100*steal/hz/el, ao, ups_conns, ups_reqs }')
    local other steal; other=$(cut -f7 <<< "$row"); steal=$(cut -f8 <<< "$row")
    local disturbed=0
    awk -v o="$other" -v m="$QUIET_MAX" -v s="$steal" -v sm="$STEAL_MAX" 'BEGIN{exit !(o > m || s > sm)}' && disturbed=1
    ((quiet == 0)) && disturbed=1
    if ((disturbed == 1 && attempt < RETRIES)); then
      log "  $scen/$target round $round: disturbed (other processes ${other}%, hypervisor steal ${steal}% of a core; $rps req/s) - retrying"
      attempt=$((attempt + 1)); sleep 3; continue
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$scen" "$target" "$round" "$rps" "$p50" "$p99" \
      "$reqs" "$non2xx" "$errs" "$row" "$disturbed" "$attempt" >> "$TSV"
    log "  $scen/$target round $round: $rps req/s  p50=${p50}us p99=${p99}us  non2xx=$non2xx  other=${other}% steal=${steal}%$( ((disturbed)) && echo '  [DISTURBED, kept]')"
    return 0
  done
}

warmup() {  # url
  pin "$CLIENT_CPUS" wrk -t"$THREADS" -c"$CONNS" -d"$WARMUP" "$1" >/dev/null 2>&1
}

# ---------------------------------------------------------------------------------- main
for p in $P_UP $P_UP_H2 $P_UP_STATUS $P_NGX $P_NGX_H2 $P_NGX_REJ $P_HAP $P_HAP_REJ $P_HAP_H2 \
         $CANDIDATE_PORT $CANDIDATE_REJECT_PORT $CANDIDATE_H2_PORT \
         $CANDIDATE2_PORT $CANDIDATE2_REJECT_PORT $CANDIDATE2_H2_PORT; do
  port_busy "$p" && die "port $p is already in use - refusing to benchmark someone else's server"
done

write_configs
log "work dir: $WORK_DIR  results: $OUT"
log "pinning: PIN=$PIN proxy->cpu $SERVER_CPUS, upstream->cpu $UPSTREAM_CPUS, load generator->cpu $CLIENT_CPUS"
start_nginx upstream "$CONF/upstream.conf" "$UPSTREAM_CPUS"
start_nginx nginx-proxy "$CONF/nginx-proxy.conf" "$SERVER_CPUS"
start_haproxy "$SERVER_CPUS"
UNITS[direct]=upstream UNITS[nginx]=nginx-proxy UNITS[haproxy]=haproxy

declare -A URL_PASS=([direct]=http://127.0.0.1:$P_UP/ [nginx]=http://127.0.0.1:$P_NGX/ [haproxy]=http://127.0.0.1:$P_HAP/)
declare -A URL_REJ=([nginx]=http://127.0.0.1:$P_NGX_REJ/ [haproxy]=http://127.0.0.1:$P_HAP_REJ/)
declare -A URL_H2=([direct]=http://127.0.0.1:$P_UP_H2/ [nginx]=http://127.0.0.1:$P_NGX_H2/ [haproxy]=http://127.0.0.1:$P_HAP_H2/)
PASS_TARGETS=(direct nginx haproxy) REJ_TARGETS=(nginx haproxy) H2_TARGETS=(direct nginx haproxy)

# add_candidate NAME CMD PORT REJECT_PORT H2_PORT [REJECT_CMD]: start it, give it its rows
add_candidate() {
  local name=$1 cmd=$2 port=$3 rej_port=$4 h2_port=$5 rej_cmd=${6:-}
  [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || die "candidate name '$name' must be [A-Za-z0-9_-]+"
  start_candidate "$name" "$cmd" "$port" "$rej_port" "$h2_port"
  UNITS[$name]=$name
  if [[ -n $rej_cmd ]]; then
    start_candidate "$name-reject" "$rej_cmd" "$port" "$rej_port" "$h2_port"; UNITS[$name]="$name $name-reject"
  fi
  URL_PASS[$name]=http://127.0.0.1:$port/; PASS_TARGETS+=("$name")
  [[ -n $rej_port ]] && { URL_REJ[$name]=http://127.0.0.1:$rej_port/; REJ_TARGETS+=("$name"); }
  [[ -n $h2_port ]] && { URL_H2[$name]=http://127.0.0.1:$h2_port/; H2_TARGETS+=("$name"); }
  return 0
}
C=$CANDIDATE_NAME C2=$CANDIDATE2_NAME
if [[ -n $CANDIDATE_CMD ]]; then
  add_candidate "$C" "$CANDIDATE_CMD" "$CANDIDATE_PORT" "$CANDIDATE_REJECT_PORT" "$CANDIDATE_H2_PORT" "$CANDIDATE_REJECT_CMD"
fi
if [[ -n $CANDIDATE2_CMD ]]; then
  add_candidate "$C2" "$CANDIDATE2_CMD" "$CANDIDATE2_PORT" "$CANDIDATE2_REJECT_PORT" "$CANDIDATE2_H2_PORT"
fi

for p in $P_UP $P_UP_STATUS $P_NGX $P_NGX_REJ $P_HAP $P_HAP_REJ $CANDIDATE_PORT $CANDIDATE_REJECT_PORT \
         $CANDIDATE2_PORT $CANDIDATE2_REJECT_PORT; do
  wait_port "$p" || die "nothing answers on port $p (see $LOGS/)"
done
for t in "${PASS_TARGETS[@]}"; do   # sanity: every pass target must return 200 "ok"
  body=$(curl -s -m 2 -w ' %{http_code}' "${URL_PASS[$t]}")
  [[ $body == $'ok\n 200' ]] || die "$t (${URL_PASS[$t]}) did not return 200 'ok\\n' (got: $body)"
done

unit_threads() { local n=0 pid; for pid in $(unit_pids "$1"); do n=$((n + $(awk '/^Threads:/{print $2}' "/proc/$pid/status" 2>/dev/null || echo 0))); done; echo "$n"; }
threads_line="processes/threads:"
for u in upstream nginx-proxy haproxy ${CANDIDATE_CMD:+$C} ${CANDIDATE_REJECT_CMD:+$C-reject} ${CANDIDATE2_CMD:+$C2}; do
  threads_line+=" $u=$(unit_pids "$u" | wc -l)p/$(unit_threads "$u")t"
done
log "$threads_line"
{
  echo "# run $RUN_ID  host=$(hostname) nproc=$(nproc) kernel=$(uname -r)"
  echo "# $threads_line"
  echo "# $($NGINX -v 2>&1 | tr -d '\n') | $($HAPROXY -v | head -1) | $(wrk --version 2>&1 | head -1 | cut -c1-40) | $(h2load --version 2>/dev/null | head -1)"
  echo "# PIN=$PIN server_cpus=$SERVER_CPUS upstream_cpus=$UPSTREAM_CPUS client_cpus=$CLIENT_CPUS wrk -t$THREADS -c$CONNS -d$DURATION rounds=$ROUNDS h2load -n$H2_REQUESTS -c$CONNS -m$H2_STREAMS candidate=${CANDIDATE_CMD:+$C} candidate2=${CANDIDATE2_CMD:+$C2}"
  printf 'scenario\ttarget\tround\trps\tp50_us\tp99_us\trequests\tnon2xx\tsock_err\tproxy_us_per_req\tupstream_us_per_req\tproxy_cpu_pct\tloadgen_cpu_pct\tserver_core_busy_pct\tclient_core_busy_pct\tother_cpu_pct\tsteal_pct\ttcp_active_opens\tupstream_new_conns\tupstream_requests\tdisturbed\tretries\n'
} > "$TSV"

for scen in $SCENARIOS; do
  case $scen in
    pass)   declare -n URLS=URL_PASS; targets=("${PASS_TARGETS[@]}"); tool=wrk ;;
    reject) declare -n URLS=URL_REJ;  targets=("${REJ_TARGETS[@]}");  tool=wrk ;;
    h2)     declare -n URLS=URL_H2;   targets=("${H2_TARGETS[@]}");   tool=h2load ;;
    *) die "unknown scenario $scen" ;;
  esac
  log "scenario $scen: targets ${targets[*]}, $ROUNDS interleaved rounds"
  for t in "${targets[@]}"; do warmup "${URLS[$t]}"; done
  for r in $(seq 1 "$ROUNDS"); do
    for t in "${targets[@]}"; do
      measure "$scen" "$t" "$r" "${URLS[$t]}" "$tool"
    done
  done
  unset -n URLS
done

python3 "$BENCH_DIR/summarize.py" "$TSV" | tee "$OUT/summary.txt"
log "raw wrk/h2load outputs: $RAW"
