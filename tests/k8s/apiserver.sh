#!/usr/bin/env bash
# Runs a real Kubernetes control plane for Egret's integration tests: etcd (Debian's
# etcd-server 3.4) and the kube-apiserver built by tests/k8s/build-apiserver.sh, both
# listening on 127.0.0.1 only, on free ports, with every file in one state directory.
#
# Usage: tests/k8s/apiserver.sh check|start|stop|status|env|kill-apiserver|restart-apiserver
#
# By default both listen on 127.0.0.1 of the machine. With EGRET_APISERVER_NETNS set at
# `start`, both run inside that network namespace instead (the lab's "control"
# namespace): etcd on that namespace's own 127.0.0.1, the API server on
# EGRET_APISERVER_ADDRESS there (an address the caller configured on a link of that
# namespace); nothing listens in the namespace the script was called from. The choice is
# recorded in the state directory, so the other commands need only EGRET_APISERVER_STATE.
#   check              exit 0 when the binaries are there, 4 (with what is missing) if not
#   start              start etcd and the API server unless already running; wait until
#                      /readyz answers "ok"; print the kubeconfig path
#   stop               stop both (and the owner watcher) and remove the state directory
#   status             exit 0 when both run and /readyz is ok, 3 when stopped, 1 otherwise
#   env                print KUBECONFIG=<path> (exit 3 when not running)
#   kill-apiserver     SIGKILL the API server only (etcd keeps running): a control plane
#                      that vanished without a goodbye
#   restart-apiserver  (re)start the API server on the same port and state; wait until ready
#
# Environment:
#   EGRET_APISERVER_STATE        state directory (default /tmp/egret-apiserver-$USER)
#   EGRET_APISERVER_OWNER_PID    when set at start: a watcher stops everything once
#                                that process is gone (tests that are killed leak nothing)
#   EGRET_APISERVER_TIMEOUT      seconds to wait for readiness (default 300: a restart
#                                beside two CPU hogs and a loaded lab took over 90 s)
#   EGRET_APISERVER_SERVICE_CIDR service cluster IP range (default 192.0.2.0/24, TEST-NET-1;
#                                only stored by the API server, never configured on a link)
#   EGRET_KUBE_APISERVER, EGRET_ETCD  binaries (default: the build cache, etcd on PATH)
#   EGRET_APISERVER_NICE         nice level of etcd and the API server (default -10)
#   EGRET_APISERVER_NETNS        at start: run both inside this network namespace
#   EGRET_APISERVER_ADDRESS      at start: the API server's address (default 127.0.0.1;
#                                with a namespace, an address of that namespace)
#
# The admin user authenticates with a static bearer token and is in group
# system:masters; authorization is RBAC. The serving certificate is the API server's
# own self-signed one; the kubeconfig trusts the CA it generated with it.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/$(basename "${BASH_SOURCE[0]}")
# shellcheck source=common.sh
source "$here/common.sh"
# shellcheck source=../instance.sh
source "$here/../instance.sh"

state=${EGRET_APISERVER_STATE:-/tmp/egret-apiserver-$(id -un)}
apiserver_bin=${EGRET_KUBE_APISERVER:-$EGRET_KUBE_APISERVER_BIN}
etcd_bin=${EGRET_ETCD:-$(command -v etcd || echo /usr/bin/etcd)}
timeout=${EGRET_APISERVER_TIMEOUT:-300}
service_cidr=${EGRET_APISERVER_SERVICE_CIDR:-192.0.2.0/24}
# Where the pair runs; `start` records both in config.env, later commands read them back.
netns=${EGRET_APISERVER_NETNS:-}
address=${EGRET_APISERVER_ADDRESS:-127.0.0.1}

log() { printf '[apiserver.sh] %s\n' "$*" >&2 || true; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# `inns` (tests/instance.sh) as a command prefix for `spawn` (setsid cannot run a
# function).
inns_prefix() {
  prefix=()
  [ -z "$netns" ] || prefix=(ip netns exec "$netns")
}

# Reads config.env (ports, token, and where the pair runs).
load_env() {
  # shellcheck source=/dev/null
  [ -f "$state/config.env" ] && source "$state/config.env" || return 1
  netns=${APISERVER_NETNS:-}
  address=${APISERVER_ADDRESS:-127.0.0.1}
}


kubeconfig=$state/kubeconfig

# A slow server that is up still answers: 10 s, not 2 (beside CPU hogs and
# a burst of requests after a restart /readyz took longer than 2 s on every
# probe, and the wait gave up on a server that was serving).
ready() {
  load_env || return 1
  [ -f "$state/ca.crt" ] || return 1
  [ "$(inns curl -s --max-time 10 --cacert "$state/ca.crt" -H "Authorization: Bearer $ADMIN_TOKEN" \
       "https://$address:$APISERVER_PORT/readyz" 2>/dev/null)" = ok ]
}

# Which readiness checks fail, for the log of a wait that gave up.
readyz_verbose() {
  load_env && [ -f "$state/ca.crt" ] || return 0
  inns curl -s --max-time 5 --cacert "$state/ca.crt" -H "Authorization: Bearer $ADMIN_TOKEN" \
    "https://$address:$APISERVER_PORT/readyz?verbose" 2>&1 || echo "(no answer to /readyz?verbose within 5 s)"
}

running() { live_pid etcd >/dev/null && live_pid apiserver >/dev/null; }

# The CA that signed the API server's self-signed serving certificate: the
# self-issued certificate in the bundle it wrote to pki/apiserver.crt.
extract_ca() {
  local bundle=$state/pki/apiserver.crt dir=$state/pki/split f
  [ -s "$bundle" ] || return 1
  rm -rf "$dir"; mkdir -p "$dir"
  awk -v dir="$dir" '/-----BEGIN CERTIFICATE-----/ { n++ } n { print > (dir "/" n ".pem") }' "$bundle"
  for f in "$dir"/*.pem; do
    if [ "$(openssl x509 -in "$f" -noout -subject -nameopt RFC2253 | sed 's/^subject=//')" = \
         "$(openssl x509 -in "$f" -noout -issuer -nameopt RFC2253 | sed 's/^issuer=//')" ]; then
      cp "$f" "$state/ca.crt.new" && mv "$state/ca.crt.new" "$state/ca.crt"
      rm -rf "$dir"
      return 0
    fi
  done
  rm -rf "$dir"
  return 1
}

write_kubeconfig() {
  load_env
  umask 077
  cat >"$kubeconfig.new" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: egret-test
  cluster:
    server: https://$address:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 <"$state/ca.crt")
users:
- name: egret-admin
  user:
    token: $ADMIN_TOKEN
contexts:
- name: egret-test
  context:
    cluster: egret-test
    user: egret-admin
    namespace: default
current-context: egret-test
EOF
  mv "$kubeconfig.new" "$kubeconfig"
}

# The lab's etcd and API server stand for a cluster's control plane, which runs on
# machines of its own, not on the gateways' cores: they run at a higher CPU priority
# (nice -10, about nine times a default process's share when the CPUs are contended),
# so that the CPU hogs of the HA lab starve the gateways, not the control plane
# (beside two hogs at the default priority, a restarted API server did not become
# ready in 300 s, or its etcd client timed out and it exited, in 4 of 5 runs).
#
# With autogroup scheduling (kernel.sched_autogroup_enabled=1, the default of
# Debian's kernels), a process's nice value ranks it only within its session: each
# session shares the CPUs with the others as one group. Both run in sessions of their
# own (setsid), so the priority is set on the session's group too
# (/proc/PID/autogroup, tests/sched.sh). Without it a restarted API server beside two hogs
# took 62-114 s to be ready instead of 9 s (5.3 s with
# the group's priority set), and once exited ("TLS handshake timeout" on its
# own loopback client, then "Unable to perform initial IP allocation check").
nice_level=${EGRET_APISERVER_NICE:--10}

start_etcd() {
  load_env
  # etcd always listens on loopback: the machine's, or the namespace's own.
  local prefix
  inns_prefix
  spawn etcd "${prefix[@]}" "$etcd_bin" \
    --name egret-test \
    --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "egret-test=http://127.0.0.1:$ETCD_PEER_PORT" \
    --log-level warn --logger zap
}

start_apiserver_proc() {
  load_env
  # The self-signed serving certificate names the advertise address.
  local prefix
  inns_prefix
  spawn apiserver "${prefix[@]}" "$apiserver_bin" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$address" \
    --advertise-address "$address" \
    --secure-port "$APISERVER_PORT" \
    --insecure-port 0 \
    --cert-dir "$state/pki" \
    --token-auth-file "$state/tokens.csv" \
    --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$state/sa.pub" \
    --service-account-signing-key-file "$state/sa.key" \
    --service-cluster-ip-range "$service_cidr" \
    --disable-admission-plugins ServiceAccount \
    --endpoint-reconciler-type none \
    --profiling=false \
    --v 1
}

# Waits until $1 (a function) succeeds, while the process in $2.pid stays alive.
# Alive is "not gone", not live_pid: until the forked shell has exec'd (which took
# longer than spawn's 5 s once, beside a cold clippy and fuzz build), its command line
# is this script's, which live_pid takes for another process ("exited before it was
# ready" with an empty log).
wait_for() {
  local check=$1 name=$2 t0 pid
  t0=$(now)
  pid=$(cat "$state/$name.pid" 2>/dev/null) || pid=
  while ! "$check"; do
    { [ -n "$pid" ] && ! gone "$pid"; } || {
      log "$name exited before it was ready; its first errors (klog E/F lines), then its last log lines:"
      grep -m 8 -E '^[EF][0-9]{4} ' "$state/$name.log" >&2 || true
      tail -n 25 "$state/$name.log" >&2
      return 1
    }
    if awk -v a="$t0" -v b="$(now)" -v t="$timeout" 'BEGIN { exit !(b - a > t) }'; then
      log "$name not ready after ${timeout}s; last log lines:"; tail -n 25 "$state/$name.log" >&2
      if [ "$name" = apiserver ]; then log "/readyz?verbose:"; readyz_verbose >&2; fi
      return 1
    fi
    sleep 0.2
  done
}

etcd_ready() {
  load_env
  inns curl -s --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'
}
apiserver_ready() { { [ -f "$state/ca.crt" ] || extract_ca; } && ready; }

wait_apiserver() {
  local t0=$1
  wait_for apiserver_ready apiserver || return 1
  write_kubeconfig
  log "API server ready at https://$address:$APISERVER_PORT${netns:+ in network namespace $netns} in $(elapsed "$t0")s (pid $(live_pid apiserver))"
}


cmd_stop() {
  stop_proc watcher
  stop_proc apiserver
  stop_proc etcd
  rm -rf "$state"
  rm -f "$state.lock"
}

cmd_check() {
  [ -x "$apiserver_bin" ] || { log "no kube-apiserver at $apiserver_bin: run tests/k8s/build-apiserver.sh"; exit 4; }
  [ -x "$etcd_bin" ] || { log "no etcd at $etcd_bin: run tests/k8s/build-apiserver.sh (installs etcd-server)"; exit 4; }
  if ! command -v openssl >/dev/null || ! command -v curl >/dev/null; then
    log "openssl and curl are needed: run tests/k8s/build-apiserver.sh"; exit 4
  fi
}

cmd_start() {
  cmd_check
  if [ -n "$netns" ] && [ ! -e "/run/netns/$netns" ]; then
    die "EGRET_APISERVER_NETNS=$netns: no such network namespace (ip netns add it first)"
  fi
  lock
  if running && ready; then
    log "already running (state $state)"
    echo "$kubeconfig"
    return 0
  fi
  if [ -e "$state" ]; then
    log "removing stale state $state"
    stop_proc watcher; stop_proc apiserver; stop_proc etcd; rm -rf "$state"
  fi

  local t0 attempt
  t0=$(now)
  mkdir -p "$state"
  chmod 700 "$state"
  umask 077
  if [ -n "${EGRET_APISERVER_OWNER_PID:-}" ]; then
    watch_owner "$EGRET_APISERVER_OWNER_PID" EGRET_APISERVER_STATE egret-apiserver-watcher
  fi
  for attempt in 1 2 3; do
    mkdir -p "$state/pki"
    local client_p peer_p api_p
    client_p=$(free_port); peer_p=$(free_port); api_p=$(free_port)
    while [ "$peer_p" = "$client_p" ]; do peer_p=$(free_port); done
    while [ "$api_p" = "$client_p" ] || [ "$api_p" = "$peer_p" ]; do api_p=$(free_port); done
    local token
    token=$(openssl rand -hex 32)
    cat >"$state/config.env" <<EOF
ETCD_PORT=$client_p
ETCD_PEER_PORT=$peer_p
APISERVER_PORT=$api_p
ADMIN_TOKEN=$token
APISERVER_NETNS=$netns
APISERVER_ADDRESS=$address
EOF
    # Static token file: token,user,uid,"groups".
    printf '%s,egret-admin,egret-admin,"system:masters"\n' "$token" >"$state/tokens.csv"
    openssl genrsa -out "$state/sa.key" 2048 2>/dev/null
    openssl rsa -in "$state/sa.key" -pubout -out "$state/sa.pub" 2>/dev/null

    start_etcd
    if wait_for etcd_ready etcd; then
      start_apiserver_proc
      if wait_apiserver "$t0"; then
        break
      fi
    fi
    if [ "$attempt" -lt 3 ] && grep -qs 'address already in use' "$state/etcd.log" "$state/apiserver.log"; then
      log "port taken meanwhile; retrying with other ports"
      stop_proc apiserver; stop_proc etcd
      rm -rf "$state/etcd" "$state/pki" "$state/ca.crt" "$state/etcd.log" "$state/apiserver.log"
      continue
    fi
    log "start failed; state kept for inspection in $state (run '$self stop' to remove it)"
    stop_proc watcher; stop_proc apiserver; stop_proc etcd
    exit 1
  done
  echo "$kubeconfig"
}

cmd_status() {
  if [ ! -d "$state" ]; then echo "stopped"; exit 3; fi
  local e a
  e=$(live_pid etcd || echo none); a=$(live_pid apiserver || echo none)
  if [ "$e" = none ] && [ "$a" = none ]; then echo "stopped (stale state in $state)"; exit 3; fi
  load_env || true
  if [ "$e" != none ] && [ "$a" != none ] && ready; then
    echo "running: etcd pid $e (127.0.0.1:$ETCD_PORT), kube-apiserver pid $a (https://$address:$APISERVER_PORT)${netns:+ in network namespace $netns}, KUBECONFIG=$kubeconfig"
    exit 0
  fi
  echo "degraded: etcd pid $e, kube-apiserver pid $a, ready=no"
  exit 1
}

cmd_env() {
  running || { log "not running (state $state)"; exit 3; }
  echo "KUBECONFIG=$kubeconfig"
}

cmd_kill_apiserver() {
  local pid
  pid=$(live_pid apiserver) || { log "API server not running"; return 0; }
  kill -KILL "$pid"
  while ! gone "$pid"; do sleep 0.05; done
  rm -f "$state/apiserver.pid"
  log "API server (pid $pid) killed"
}

cmd_restart_apiserver() {
  [ -f "$state/config.env" ] || die "no state in $state: use start"
  live_pid etcd >/dev/null || die "etcd is not running (state $state): use stop, then start"
  lock
  stop_proc apiserver
  local t0
  t0=$(now)
  start_apiserver_proc
  wait_apiserver "$t0" || die "API server did not come back"
}

case "${1:-}" in
  check) cmd_check ;;
  start) cmd_start ;;
  stop) lock; cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  kill-apiserver) cmd_kill_apiserver ;;
  restart-apiserver) cmd_restart_apiserver ;;
  *) echo "usage: $0 check|start|stop|status|env|kill-apiserver|restart-apiserver" >&2; exit 2 ;;
esac
