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
