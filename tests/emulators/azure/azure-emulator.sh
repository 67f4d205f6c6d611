#!/usr/bin/env bash
# Runs the ARM emulator (emulator.py beside this script, an emulator of the Azure
# Resource Manager calls Egret's Azure provider makes; README.md says what it
# emulates) on 127.0.0.1 on a free port, for the Azure provider's tests.
# Everything of one emulator is in one state directory. The protocol is
# tests/moto/moto.sh's (tests/instance.sh, tests/src/script.rs).
#
# Usage: tests/emulators/azure/azure-emulator.sh check|start|stop|status|env
#   check   exit 0 when python3 (3.11 or newer) and curl are there, 4 (saying
#           what to run) if not
#   start   start the emulator unless running; wait until it answers; print its
#           endpoint URL (http://127.0.0.1:PORT, https:// with a TLS directory)
#   stop    stop it (and the owner watcher) and remove the state directory
#   status  exit 0 when it runs and answers, 3 when stopped, 1 otherwise
#   env     print EGRET_AZURE_EMULATOR_URL=<url>, and EGRET_AZURE_EMULATOR_CA=<ca.pem>
#           when it serves HTTPS (exit 3 when not running)
#
# Environment:
#   EGRET_AZURE_EMU_STATE      state directory (default /tmp/egret-azure-emu-$USER)
#   EGRET_AZURE_EMU_OWNER_PID  when set at start: a watcher stops the emulator once
#                              that process is gone (a killed test leaks nothing)
#   EGRET_AZURE_EMU_TIMEOUT    seconds to wait for it to answer (default 30)
#   EGRET_AZURE_EMU_NETNS      at start: run it inside this network namespace (a
#                              lab's control namespace, where its gateways reach
#                              it); nothing listens where the script was called
#   EGRET_AZURE_EMU_ADDRESS    at start: the address to listen on (default
#                              127.0.0.1; with a namespace, an address of that
#                              namespace)
#   EGRET_AZURE_EMU_TLS_DIR    at start: serve HTTPS with <dir>/server.pem and
#                              <dir>/server.key (a chain to <dir>/ca.pem, which the
#                              readiness check trusts); the endpoint is https://.
#                              azure_core's bearer-token policy refuses plain http,
#                              so a client built on it needs this
#   All three are recorded in the state directory for the other commands.
#
# The emulator picks its own free port (it binds port 0) and writes it to
# <state>/port; its output goes to <state>/emulator.log.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/$(basename "${BASH_SOURCE[0]}")
# shellcheck source=../../instance.sh
source "$here/../../instance.sh"

state=${EGRET_AZURE_EMU_STATE:-/tmp/egret-azure-emu-$(id -un)}
state=${state%/}
timeout=${EGRET_AZURE_EMU_TIMEOUT:-30}

log() { printf '[azure-emulator.sh] %s\n' "$*" >&2 || true; }
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
  local scheme=http
  [ -z "$tls" ] || scheme=https
  [ -f "$state/port" ] && printf '%s://%s:%s\n' "$scheme" "$address" "$(cat "$state/port")"
}

# The control API's health call answers once the emulator serves.
answers() {
  local url
  load_where
  url=$(endpoint) || return 1
  local trust=()
  [ -z "$tls" ] || trust=(--cacert "$tls/ca.pem")
  inns curl -s "${trust[@]}" -o /dev/null --max-time 2 -w '%{http_code}' "$url/_emulator/health" 2>/dev/null \
    | grep -q '^200$'
}

cmd_check() {
  if ! command -v python3 >/dev/null || ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    log "python3 3.11 or newer is needed: run tests/install-deps.sh"; exit 4
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
  netns=${EGRET_AZURE_EMU_NETNS:-}
  address=${EGRET_AZURE_EMU_ADDRESS:-127.0.0.1}
  if [ -n "$netns" ] && [ ! -e "/run/netns/$netns" ]; then
    die "EGRET_AZURE_EMU_NETNS=$netns: no such network namespace (ip netns add it first)"
  fi
  printf '%s\n' "$netns" >"$state/netns"
  printf '%s\n' "$address" >"$state/address"
  tls=${EGRET_AZURE_EMU_TLS_DIR:-}
  local serve=(--address "$address")
  if [ -n "$tls" ]; then
    tls=$(cd "$tls" && pwd)
    for f in ca.pem server.pem server.key; do
      [ -r "$tls/$f" ] || die "EGRET_AZURE_EMU_TLS_DIR=$tls: no readable $f"
    done
    printf '%s\n' "$tls" >"$state/tls"
    serve+=(--tls-dir "$tls")
  fi
  local prefix=()
  [ -z "$netns" ] || prefix=(ip netns exec "$netns")
  if [ -n "${EGRET_AZURE_EMU_OWNER_PID:-}" ]; then
    watch_owner "$EGRET_AZURE_EMU_OWNER_PID" EGRET_AZURE_EMU_STATE egret-azure-emu-watcher
  fi
  local t0
  t0=$(date +%s)
  # The port file names the state directory on the command line: live_pid
  # knows the process by it.
  spawn emulator "${prefix[@]}" python3 -B "$here/emulator.py" "${serve[@]}" --port 0 --port-file "$state/port"
  while ! answers; do
    live_pid emulator >/dev/null || break
    if [ $(($(date +%s) - t0)) -gt "$timeout" ]; then
      log "the emulator is not answering after ${timeout}s; last log lines:"; tail -n 25 "$state/emulator.log" >&2
      cmd_stop; exit 1
    fi
    sleep 0.1
  done
  if live_pid emulator >/dev/null && answers; then
    log "ARM emulator at $(endpoint) in $(($(date +%s) - t0))s (pid $(live_pid emulator))"
    endpoint
    return 0
  fi
  log "the emulator exited before it answered; last log lines:"; tail -n 25 "$state/emulator.log" >&2
  cmd_stop
  exit 1
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
  load_where
  echo "EGRET_AZURE_EMULATOR_URL=$(endpoint)"
  [ -z "$tls" ] || echo "EGRET_AZURE_EMULATOR_CA=$tls/ca.pem"
}

case "${1:-}" in
  check) cmd_check ;;
  start) cmd_start ;;
  stop) lock; cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 check|start|stop|status|env" >&2; exit 2 ;;
esac
