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

# An nginx HTTP/2 upstream on port $2 answering `return 200` (h2c; with TLS=1 `ssl http2` with
# a leaf signed by a CA made here: webpki refuses a certificate marked CA:TRUE, as `req -x509`
# makes, as the leaf), its config written to $1/nginx.conf and started (pinned to $3 if
# given). Sets `url` and `proto` (tollgate's `protocol:` and TLS fields) for the caller.
start_h2_upstream() {
  local work=$1 up=$2 cpus=${3:-}
  local listen="listen 127.0.0.1:$up http2;"
  url=http://127.0.0.1:$up proto=h2c
  if [[ -n ${TLS:-} ]]; then
    local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
    openssl req -x509 "${ec[@]}" -days 2 -subj /CN=bench-ca -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
    openssl req "${ec[@]}" -subj /CN=upstream.bench -keyout "$work/up.key" -out "$work/up.csr" 2>/dev/null
    printf 'subjectAltName=DNS:upstream.bench\nbasicConstraints=CA:FALSE\n' > "$work/ext.cnf"
    openssl x509 -req -in "$work/up.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" -CAcreateserial -days 2 \
      -extfile "$work/ext.cnf" -out "$work/up.pem" 2>/dev/null
    listen="listen 127.0.0.1:$up ssl http2; ssl_certificate $work/up.pem; ssl_certificate_key $work/up.key;"
    url=https://127.0.0.1:$up proto="h2, ca_file: '$work/ca.pem', server_name: upstream.bench"
  fi
  cat > "$work/nginx.conf" <<NGX
worker_processes 1; daemon on; pid $work/nginx.pid; error_log $work/error.log crit;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000000; http2_max_concurrent_streams 1000;
  server { $listen location / { return 200 "ok\n"; } } }
NGX
  if [[ -n $cpus ]]; then
    taskset -c "$cpus" nginx -c "$work/nginx.conf" -p "$work"
  else
    nginx -c "$work/nginx.conf" -p "$work"
  fi
}
