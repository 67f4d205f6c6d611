#!/usr/bin/env bash
# Runs the Compute Engine emulator (gcp_emulator.py beside this script: an
# emulator of the calls Egret's GCP provider makes, not Google Cloud; see
# README.md) on 127.0.0.1 for the GCP provider's tests. Everything of one
# emulator is in one state directory. Python 3.11's standard library is all it
# needs.
#
# Usage: tests/emulators/gcp/gcp-emulator.sh check|start|stop|status|env
#   check   exit 0 when python3 (3.11 or newer) and curl are there, 4 if not
#   start   start the emulator unless running; wait until it answers; print its
#           endpoint URL (http://127.0.0.1:PORT)
#   stop    stop it (and the owner watcher) and remove the state directory
#   status  exit 0 when it runs and answers, 3 when stopped, 1 otherwise
#   env     print EGRET_GCP_EMULATOR_ENDPOINT=<url> (the client's endpoint:
#           ClientBuilder::with_endpoint), EGRET_GCP_EMULATOR_PROJECT=<project>
#           and, with TLS, EGRET_GCP_EMULATOR_CA=<ca.pem> (exit 3 when not running)
#
# Environment:
#   EGRET_GCP_EMULATOR_STATE      state directory (default /tmp/egret-gcp-emulator-$USER)
#   EGRET_GCP_EMULATOR_OWNER_PID  when set at start: a watcher stops the emulator
#                                 once that process is gone (a killed test leaks nothing)
#   EGRET_GCP_EMULATOR_TIMEOUT    seconds to wait for it to answer (default 30)
#   EGRET_GCP_EMULATOR_PYTHON     the interpreter (default python3)
#   EGRET_GCP_EMULATOR_NETNS      at start: run it inside this network namespace
#                                 (the cloud lab's control namespace, where its
#                                 gateways reach it); nothing listens where the
#                                 script was called
#   EGRET_GCP_EMULATOR_ADDRESS    at start: the address to listen on (default
#                                 127.0.0.1; with a namespace, an address of it)
#   EGRET_GCP_EMULATOR_TLS_DIR    at start: serve HTTPS with <dir>/server.pem and
#                                 <dir>/server.key (a chain to <dir>/ca.pem, which
#                                 the readiness check trusts); the endpoint is https://
#   EGRET_GCP_EMULATOR_ARGS       at start: more gcp_emulator.py options, split on
#                                 spaces (--allow-anonymous, --operation-delay S,
#                                 --staleness S, --page-size N, --seed FILE)
#   The namespace, address and TLS directory are recorded in the state
#   directory for the other commands.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/$(basename "${BASH_SOURCE[0]}")
# shellcheck source=../../instance.sh
source "$here/../../instance.sh"

state=${EGRET_GCP_EMULATOR_STATE:-/tmp/egret-gcp-emulator-$(id -un)}
state=${state%/}
timeout=${EGRET_GCP_EMULATOR_TIMEOUT:-30}
python=${EGRET_GCP_EMULATOR_PYTHON:-python3}

log() { printf '[gcp-emulator.sh] %s\n' "$*" >&2 || true; }
die() { log "ERROR: $*"; exit 1; }

# Where the emulator runs: recorded at start, read by every other command.
netns=; address=127.0.0.1; tls=
load_where() {
  [ -f "$state/netns" ] && netns=$(cat "$state/netns")
  [ -f "$state/address" ] && address=$(cat "$state/address")
  [ -f "$state/tls" ] && tls=$(cat "$state/tls")
  return 0
}

endpoint() {
  load_where
  local scheme=http host=$address
  [ -z "$tls" ] || scheme=https
  case $host in *:*) host="[$host]" ;; esac
  [ -s "$state/port" ] && printf '%s://%s:%s\n' "$scheme" "$host" "$(cat "$state/port")"
}

# The control API answers once the server listens (the port file is written
# after the bind).
control() { # path: prints the answer of GET /_emulator/<path>
  local url
  load_where
  url=$(endpoint) || return 1
  local trust=()
  [ -z "$tls" ] || trust=(--cacert "$tls/ca.pem")
  inns curl -sf "${trust[@]}" --max-time 2 "$url/_emulator/$1" 2>/dev/null
}
answers() { control health >/dev/null; }

cmd_check() {
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    log "$python 3.11 or newer is needed: run tests/install-deps.sh"; exit 4
  fi
  command -v curl >/dev/null || { log "curl is needed: run tests/install-deps.sh"; exit 4; }
}

cmd_stop() {
  stop_proc watcher
  stop_proc emulator
  rm -rf "$state"
  rm -f "$state.lock"
}

cmd_start() {
  cmd_check
  lock
  if live_pid emulator >/dev/null && answers; then
    log "already running (state $state)"
    endpoint
    return 0
  fi
  if [ -e "$state" ]; then
    log "removing stale state $state"
    stop_proc watcher; stop_proc emulator; rm -rf "$state"
  fi
  mkdir -p "$state"
  netns=${EGRET_GCP_EMULATOR_NETNS:-}
  address=${EGRET_GCP_EMULATOR_ADDRESS:-127.0.0.1}
  if [ -n "$netns" ] && [ ! -e "/run/netns/$netns" ]; then
    die "EGRET_GCP_EMULATOR_NETNS=$netns: no such network namespace (ip netns add it first)"
  fi
  printf '%s\n' "$netns" >"$state/netns"
  printf '%s\n' "$address" >"$state/address"
  tls=${EGRET_GCP_EMULATOR_TLS_DIR:-}
  local serve=(--address "$address" --port 0 --port-file "$state/port")
  if [ -n "$tls" ]; then
    tls=$(cd "$tls" && pwd)
    for f in ca.pem server.pem server.key; do
      [ -r "$tls/$f" ] || die "EGRET_GCP_EMULATOR_TLS_DIR=$tls: no readable $f"
    done
    printf '%s\n' "$tls" >"$state/tls"
    serve+=(--tls-dir "$tls")
  fi
  local extra=()
  read -ra extra <<<"${EGRET_GCP_EMULATOR_ARGS:-}"
  local prefix=()
  [ -z "$netns" ] || prefix=(ip netns exec "$netns")
  if [ -n "${EGRET_GCP_EMULATOR_OWNER_PID:-}" ]; then
    watch_owner "$EGRET_GCP_EMULATOR_OWNER_PID" EGRET_GCP_EMULATOR_STATE egret-gcp-emulator-watcher
  fi
  local t0
  t0=$(date +%s)
  # The kernel picks a free port (--port 0) and the emulator writes it down
  # once bound, so no port can be taken between choosing and binding it. The
  # state directory on the command line is how live_pid knows the process.
  spawn emulator "${prefix[@]}" "$python" "$here/gcp_emulator.py" --state-dir "$state/" "${serve[@]}" "${extra[@]}"
  while ! answers; do
    if ! live_pid emulator >/dev/null; then
      log "the emulator exited before it answered; last log lines:"; tail -n 25 "$state/emulator.log" >&2
      cmd_stop; exit 1
    fi
    if [ $(($(date +%s) - t0)) -gt "$timeout" ]; then
      log "the emulator is not answering after ${timeout}s; last log lines:"; tail -n 25 "$state/emulator.log" >&2
      cmd_stop; exit 1
    fi
    sleep 0.1
  done
  log "emulator at $(endpoint) in $(($(date +%s) - t0))s (pid $(live_pid emulator))"
  endpoint
}

cmd_status() {
  [ -d "$state" ] || { echo "stopped"; exit 3; }
  local pid
  pid=$(live_pid emulator || echo none)
  [ "$pid" != none ] || { echo "stopped (stale state in $state)"; exit 3; }
  if answers; then echo "running: emulator pid $pid at $(endpoint)"; exit 0; fi
  echo "degraded: emulator pid $pid, not answering"; exit 1
}

cmd_env() {
  live_pid emulator >/dev/null || { log "not running (state $state)"; exit 3; }
  local health project
  health=$(control health) || die "the emulator at $(endpoint) does not answer"
  project=$("$python" -c 'import json, sys; print(json.load(sys.stdin)["project"])' <<<"$health")
  echo "EGRET_GCP_EMULATOR_ENDPOINT=$(endpoint)"
  echo "EGRET_GCP_EMULATOR_PROJECT=$project"
  [ -z "$tls" ] || echo "EGRET_GCP_EMULATOR_CA=$tls/ca.pem"
}

case "${1:-}" in
  check) cmd_check ;;
  start) cmd_start ;;
  stop) lock; cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 check|start|stop|status|env" >&2; exit 2 ;;
esac
