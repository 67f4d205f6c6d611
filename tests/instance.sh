# Sourced by the scripts that run one instance of a real component per state
# directory for the tests: tests/k8s/apiserver.sh (etcd and the API server)
# and tests/moto/moto.sh (moto). tests/src/script.rs is the Rust side of the
# same protocol.
#
# The sourcing script sets, before calling these:
#   state       the instance's directory; each of its processes names it on
#               its command line, which is how they are told from others
#   netns       (optional) the network namespace the instance listens in
#   address     the address it listens on (default 127.0.0.1)
#   nice_level  (optional) the niceness of what `spawn` starts (default 0)
#   self        the script's own path (the owner watcher runs "$self" stop)
# and defines `log` and `die`.

# shellcheck source=sched.sh
source "$(dirname "${BASH_SOURCE[0]}")/sched.sh"

# A pid from a pid file, only if that process is alive and is ours: its command line
# names a path inside the state directory (guards against pid reuse; "$state/" so that
# /tmp/x-1 does not claim the processes of /tmp/x-10).
#
# A process in the middle of an exec (setsid, then nice, then the component:
# `spawn` execs three times) shows an empty command line until the new
# program's arguments are in place (between the kernel's exec_mmap and
# create_elf_tables). On a loaded machine that moment is long enough to be
# read: "exited before it answered" with an empty log (cloud_gcp in .ci/run,
# 2026-12-02). An empty command line of a live process is read again.
live_pid() {
  local file=$state/$1.pid pid cmd
  [ -f "$file" ] || return 1
  pid=$(cat "$file")
  [ -n "$pid" ] || return 1
  for _ in $(seq 100); do
    [ -r "/proc/$pid/cmdline" ] || return 1
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    if [ -n "$cmd" ] || gone "$pid"; then break; fi
    sleep 0.01
  done
  grep -qF -- "$state/" <<<"$cmd" || return 1
  printf '%s\n' "$pid"
}

# A process that exited is gone even while it waits as a zombie for its new parent
# (init, once the script that started it has exited) to reap it.
gone() { [ ! -d "/proc/$1" ] || grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

# Stops the process recorded in $1.pid: SIGTERM, then SIGKILL after 10 s.
stop_proc() {
  local name=$1 pid
  pid=$(live_pid "$name") || { rm -f "$state/$name.pid"; return 0; }
  [ "$pid" = "$$" ] && return 0
  # Spawned processes lead their own process group (setsid): signal the group, so a
  # watcher's `sleep` goes too.
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    gone "$pid" && break
    sleep 0.1
  done
  if ! gone "$pid"; then
    log "$name (pid $pid) ignored SIGTERM for 10 s; SIGKILL"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$state/$name.pid"
}

# Runs "$@" inside the instance's network namespace (or here, without one).
inns() {
  if [ -n "${netns:-}" ]; then ip netns exec "$netns" "$@"; else "$@"; fi
}

# shellcheck disable=SC2016 # expanded by the inner bash
port_in_use() { inns bash -c 'exec 3<>"/dev/tcp/$0/$1"' "${address:-127.0.0.1}" "$1" 2>/dev/null; }

# A port with no listener, below the kernel's ephemeral range: a port that an
# outgoing connection holds as its local port cannot be listened on either.
free_port() {
  local p lo=32768 base=20000 span
  read -r lo _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  [ "$lo" -gt $((base + 2000)) ] || base=$((lo - 12000 > 1024 ? lo - 12000 : 1024))
  span=$((lo - base))
  [ "$span" -gt 100 ] || die "ephemeral port range starts at $lo: no room for test ports below it"
  for _ in $(seq 200); do
    p=$((base + RANDOM % span))
    port_in_use "$p" || { printf '%s\n' "$p"; return 0; }
  done
  die "no free port found on ${address:-127.0.0.1}${netns:+ in network namespace $netns}"
}

spawn() { # name, command...: detached from our session; output to <name>.log
  local name=$1 level=${nice_level:-0}; shift
  setsid nice -n "$level" "$@" >>"$state/$name.log" 2>&1 </dev/null 9>&- &
  local pid=$!
  echo "$pid" >"$state/$name.pid"
  # Until the forked shell has exec'd, /proc/PID/cmdline is this script's,
  # which live_pid takes for another process ("exited before it was ready"
  # with an empty log, seen once on a loaded machine): wait for the exec or
  # the exit, at most 5 s.
  for _ in $(seq 100); do
    gone "$pid" && break
    live_pid "$name" >/dev/null && break
    sleep 0.05
  done
  session_priority "$pid" "$level"
}

# One command at a time per instance (fd 9, which spawned processes do not keep).
lock() {
  mkdir -p "$(dirname "$state")"
  exec 9>"$state.lock"
  flock 9
}

# Starts the watcher that stops the instance ("$self" stop, with the state
# variable set) once the owning process is gone, even when it was killed, also
# while a start is still under way (the stop waits for the lock). A zombie
# owner is gone.
watch_owner() { # owner pid, the state variable's name, the watcher's process name
  # shellcheck disable=SC2016 # expanded by the watcher's bash, not here
  spawn watcher bash -c \
    'while [ -d "/proc/$1" ] && ! grep -q "^State:[[:space:]]*Z" "/proc/$1/status" 2>/dev/null; do sleep 1; done
     export "$4=${2%/}"; exec "$3" stop' \
    "$3" "$1" "$state/" "$self" "$2"
}
