# Sourced by the load scripts in benches/: the upstream every one of them proxies to.
#
#   start_upstream WORKDIR PORT [CPUS]
#
# nginx with one worker answering `200 ok` on 127.0.0.1:PORT with keep-alive, pid file in
# WORKDIR (the callers' EXIT traps kill every *.pid there), pinned to CPUS when given.
start_upstream() {
  local work=$1 port=$2 cpus=${3:-}
  cat > "$work/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/nginx.pid; error_log $work/error.log crit;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000000;
  server { listen 127.0.0.1:$port; location / { return 200 "ok\n"; } } }
NGX
  if [[ -n $cpus ]]; then
    taskset -c "$cpus" nginx -c "$work/nginx.conf" -p "$work"
  else
    nginx -c "$work/nginx.conf" -p "$work"
  fi
}

#   nginx_proxy_conf FILE UPSTREAM_PORT PASS_PORT REJECT_PORT REJECT_RATE REJECT_BURST [H2_PORT] [HEAD]
#
# Writes the config of benches/harness/run.sh's nginx proxy: one worker, an upstream keep-alive
# pool, a never-rejecting `limit_req` on PASS_PORT (and on H2_PORT for h2c, when given), and
# `limit_req` at REJECT_RATE r/s with REJECT_BURST on REJECT_PORT. HEAD: the lines before
# `events` (pid, daemon, error_log, master_process).
nginx_proxy_conf() {
  local file=$1 up=$2 pass=$3 rej=$4 rate=$5 burst=$6 h2=${7:-} head=${8:-}
  local h2_listen=""; [[ -n $h2 ]] && h2_listen="listen 127.0.0.1:$h2 http2 backlog=4096;"
  cat > "$file" <<NGX
worker_processes 1; $head
events { worker_connections 8192; }
http {
    access_log off; server_tokens off; keepalive_timeout 300s; keepalive_requests 1000000000;
    limit_req_zone \$binary_remote_addr zone=pass:1m rate=100000000r/s;
    limit_req_zone \$binary_remote_addr zone=reject:1m rate=${rate}r/s;
    limit_req_status 429;
    upstream backend { server 127.0.0.1:$up; keepalive 1024; keepalive_requests 1000000000; keepalive_timeout 300s; }
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    server {
        listen 127.0.0.1:$pass backlog=4096; $h2_listen
        location / { limit_req zone=pass burst=100000000 nodelay; proxy_pass http://backend; }
    }
    server {
        listen 127.0.0.1:$rej backlog=4096;
        location / { limit_req zone=reject burst=$burst nodelay; proxy_pass http://backend; }
    }
}
NGX
}

#   haproxy_proxy_conf FILE UPSTREAM_PORT PASS_PORT REJECT_PORT REJECT_LIMIT [H2_PORT]
#
# Writes the config of benches/harness/run.sh's HAProxy: one thread, keep-alive both sides, a
# never-rejecting per-client stick-table rate limit on PASS_PORT (and H2_PORT for h2c, when
# given), and on REJECT_PORT a limit of REJECT_LIMIT accepted requests a second per client (only
# accepted requests count, like nginx's limit_req, where rejected requests use no tokens).
haproxy_proxy_conf() {
  local file=$1 up=$2 pass=$3 rej=$4 limit=$5 h2=${6:-}
  local h2_bind=""; [[ -n $h2 ]] && h2_bind="bind 127.0.0.1:$h2 proto h2"
  cat > "$file" <<HAP
global
    nbthread 1
    maxconn 8000        # needs 2 fds per conn; stays under a 20000 fd limit
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout http-keep-alive 300s
frontend fe_pass
    bind 127.0.0.1:$pass
    $h2_bind
    stick-table type ip size 100k expire 60s store http_req_rate(1s)
    http-request track-sc0 src
    http-request deny deny_status 429 if { sc_http_req_rate(0) gt 1000000000 }
    default_backend be_up
frontend fe_reject
    bind 127.0.0.1:$rej
    stick-table type ip size 100k expire 60s store gpc0_rate(1s)
    http-request track-sc0 src
    http-request deny deny_status 429 if { sc_gpc0_rate(0) ge $limit }
    http-request sc-inc-gpc0(0)
    default_backend be_up
backend be_up
    server up1 127.0.0.1:$up
HAP
}
