#!/usr/bin/env bash
# Runs moto's server (an emulator of the AWS APIs; installed by
# tests/moto/install.sh) on 127.0.0.1 on a free port, for the AWS provider's
# tests. Everything of one server is in one state directory.
#
# Usage: tests/moto/moto.sh check|start|stop|status|env
#   check   exit 0 when moto is installed, 4 (saying what to run) if not
#   start   start the server unless running; wait until it answers; print its
#           endpoint URL (http://127.0.0.1:PORT)
#   stop    stop it (and the owner watcher) and remove the state directory
#   status  exit 0 when it runs and answers, 3 when stopped, 1 otherwise
#   env     print AWS_ENDPOINT_URL_EC2=<url> and the dummy credentials and
#           region moto accepts (exit 3 when not running)
#
# Environment:
#   EGRET_MOTO_STATE      state directory (default /tmp/egret-moto-$USER)
#   EGRET_MOTO_OWNER_PID  when set at start: a watcher stops the server once that
#                         process is gone (a killed test leaks nothing)
#   EGRET_MOTO_TIMEOUT    seconds to wait for the server to answer (default 60)
#   EGRET_MOTO_VENV       the virtual environment (default: tests/moto/common.sh)
#   EGRET_MOTO_NETNS      at start: run the server inside this network namespace
#                         (the cloud lab's control namespace, where its gateways
#                         reach it); nothing listens where the script was called
#   EGRET_MOTO_ADDRESS    at start: the address to listen on (default 127.0.0.1;
#                         with a namespace, an address of that namespace)
#   EGRET_MOTO_TLS_DIR    at start: serve HTTPS with <dir>/server.pem and
#                         <dir>/server.key (a chain to <dir>/ca.pem, which the
#                         readiness check trusts); the endpoint is https://
#   All three are recorded in the state directory for the other commands.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/$(basename "${BASH_SOURCE[0]}")
# shellcheck source=common.sh
source "$here/common.sh"
# shellcheck source=../instance.sh
source "$here/../instance.sh"

state=${EGRET_MOTO_STATE:-/tmp/egret-moto-$(id -un)}
state=${state%/}
timeout=${EGRET_MOTO_TIMEOUT:-60}

log() { printf '[moto.sh] %s\n' "$*" >&2 || true; }
die() { log "ERROR: $*"; exit 1; }

# Where the server runs: recorded at start, read by every other command.
netns=; address=127.0.0.1; tls=
load_where() {
  [ -f "$state/netns" ] && netns=$(cat "$state/netns")
  [ -f "$state/address" ] && address=$(cat "$state/address")
  [ -f "$state/tls" ] && tls=$(cat "$state/tls")
  return 0
}

endpoint() {
  load_where
  local scheme=http
  [ -z "$tls" ] || scheme=https
  [ -f "$state/port" ] && printf '%s://%s:%s\n' "$scheme" "$address" "$(cat "$state/port")"
}

# moto answers its own dashboard API once its routes are loaded.
answers() {
  local url
  load_where
  url=$(endpoint) || return 1
  local trust=()
  [ -z "$tls" ] || trust=(--cacert "$tls/ca.pem")
  inns curl -s "${trust[@]}" -o /dev/null --max-time 2 -w '%{http_code}' "$url/moto-api/data.json" 2>/dev/null | grep -q '^200$'
}

cmd_check() {
  [ -x "$EGRET_MOTO_SERVER_BIN" ] && [ -f "$EGRET_MOTO_VENV/.egret-complete" ] || {
    log "moto $EGRET_MOTO_VERSION is not installed in $EGRET_MOTO_VENV: run tests/moto/install.sh"; exit 4; }
  command -v curl >/dev/null || { log "curl is needed: run tests/install-deps.sh"; exit 4; }
}

cmd_stop() {
  stop_proc watcher
  stop_proc moto
  rm -rf "$state"
  rm -f "$state.lock"
}

cmd_start() {
  cmd_check
  lock
  if live_pid moto >/dev/null && answers; then
    log "already running (state $state)"
    endpoint
    return 0
  fi
  if [ -e "$state" ]; then
    log "removing stale state $state"
    stop_proc watcher; stop_proc moto; rm -rf "$state"
  fi
  mkdir -p "$state"
  netns=${EGRET_MOTO_NETNS:-}
  address=${EGRET_MOTO_ADDRESS:-127.0.0.1}
  if [ -n "$netns" ] && [ ! -e "/run/netns/$netns" ]; then
    die "EGRET_MOTO_NETNS=$netns: no such network namespace (ip netns add it first)"
  fi
  printf '%s\n' "$netns" >"$state/netns"
  printf '%s\n' "$address" >"$state/address"
  tls=${EGRET_MOTO_TLS_DIR:-}
  local serve=(-H "$address")
  if [ -n "$tls" ]; then
    tls=$(cd "$tls" && pwd)
    for f in ca.pem server.pem server.key; do
      [ -r "$tls/$f" ] || die "EGRET_MOTO_TLS_DIR=$tls: no readable $f"
    done
    printf '%s\n' "$tls" >"$state/tls"
    serve+=(-c "$tls/server.pem" -k "$tls/server.key")
  fi
  local prefix=()
  [ -z "$netns" ] || prefix=(ip netns exec "$netns")
  if [ -n "${EGRET_MOTO_OWNER_PID:-}" ]; then
    watch_owner "$EGRET_MOTO_OWNER_PID" EGRET_MOTO_STATE egret-moto-watcher
  fi
  local attempt t0 port
  t0=$(date +%s)
  for attempt in 1 2 3; do
    port=$(free_port)
    echo "$port" >"$state/port"
    # moto's own entry point, with the state directory as an argument it never
    # reads: on the command line, live_pid knows the process by it.
    spawn moto "${prefix[@]}" "$EGRET_MOTO_VENV/bin/python" -c \
      'import sys; from moto.server import main; sys.exit(main(sys.argv[2:]))' \
      "$state/" "${serve[@]}" -p "$port"
    while ! answers; do
      if ! live_pid moto >/dev/null; then
        break
      fi
      if [ $(($(date +%s) - t0)) -gt "$timeout" ]; then
        log "moto not answering after ${timeout}s; last log lines:"; tail -n 25 "$state/moto.log" >&2
        cmd_stop; exit 1
      fi
      sleep 0.2
    done
    if live_pid moto >/dev/null && answers; then
      log "moto $EGRET_MOTO_VERSION at $(endpoint) in $(($(date +%s) - t0))s (pid $(live_pid moto))"
      endpoint
      return 0
    fi
    if [ "$attempt" -lt 3 ] && grep -qs 'Address already in use' "$state/moto.log"; then
      log "port $port taken meanwhile; retrying"
      rm -f "$state/moto.log"
      continue
    fi
    break
  done
  log "moto exited before it answered; last log lines:"; tail -n 25 "$state/moto.log" >&2
  cmd_stop
  exit 1
}

cmd_status() {
  [ -d "$state" ] || { echo "stopped"; exit 3; }
  local pid
  pid=$(live_pid moto || echo none)
  [ "$pid" != none ] || { echo "stopped (stale state in $state)"; exit 3; }
  if answers; then echo "running: moto pid $pid at $(endpoint)"; exit 0; fi
  echo "degraded: moto pid $pid, not answering"; exit 1
}

cmd_env() {
  live_pid moto >/dev/null || { log "not running (state $state)"; exit 3; }
  echo "AWS_ENDPOINT_URL_EC2=$(endpoint)"
  echo "AWS_ACCESS_KEY_ID=testing"
  echo "AWS_SECRET_ACCESS_KEY=testing"
  echo "AWS_REGION=us-east-1"
}

case "${1:-}" in
  check) cmd_check ;;
  start) cmd_start ;;
  stop) lock; cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 check|start|stop|status|env" >&2; exit 2 ;;
esac
