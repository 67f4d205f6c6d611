# Sourced by scripts that start processes in sessions of their own (setsid).
#
# With autogroup scheduling (kernel.sched_autogroup_enabled=1, the default of
# Debian's kernels) a process's nice value ranks it only within its session: each
# session shares the CPUs with the others as one group of equal weight, whatever
# the nice values inside it. So `setsid nice -n N cmd` alone does not give cmd the
# priority N against the rest of the machine; its session's group needs it too
# (/proc/PID/autogroup, sched(7)).

# Sets the autogroup priority of PID's session to NICE, once PID leads a session
# (setsid has run; waits up to 5 s for it). Does nothing without autogroups.
session_priority() { # pid nice
  local pid=$1 nice=$2 stat sid
  for _ in $(seq 100); do
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    sid=$(cut -d' ' -f4 <<<"$stat")
    if [ "$sid" = "$pid" ]; then
      [ -w "/proc/$pid/autogroup" ] || return 0
      echo "$nice" >"/proc/$pid/autogroup" 2>/dev/null \
        || printf 'could not set the autogroup priority of %s to %s\n' "$pid" "$nice" >&2
      return 0
    fi
    sleep 0.05
  done
}
