# shellcheck shell=bash
# The one way Egret's scripts install Debian packages: `egret_ensure_pkgs PKG...`.
# Sourced (through tests/k8s/common.sh, or directly), never run.
#
# What it guarantees, and why:
# - The whole set a script needs goes to apt in one transaction, never only the
#   missing part: packages that must agree (QEMU's family: qemu-system-x86,
#   qemu-system-common, qemu-utils) are then solved together.
# - apt removes nothing the machine had. A machine may come with a newer build of
#   a package than the archive's (this kind ships qemu-utils 10.0 from
#   bookworm-backports; bookworm's qemu-system-x86 7.2 conflicts with it, and a
#   plain install of qemu-system-x86 makes apt remove qemu-utils, so qemu-img
#   vanished mid-run). The transaction is first simulated; if apt would remove a
#   package, or cannot solve the set, the removed packages join the set and every
#   package of the set whose installed build is not from a configured archive is
#   asked for at the archive's version, so the family agrees. If apt still wants
#   to remove something, nothing is installed and the message names it.
# - After every install, each command of tests/tools.txt that was there before,
#   and each one whose package was asked for, is there: a failure names the
#   command and its package.
# Set EGRET_PKGS_DRY_RUN=1 to print the transaction it would run, and run none.

EGRET_TOOLS_TABLE=${EGRET_TOOLS_TABLE:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tools.txt}

# Prints the packages of "$@" that dpkg does not list as installed.
egret_missing_pkgs() {
  local pkg
  for pkg in "$@"; do
    # No `| grep -q` in this file: grep -q exits at the first match, the
    # writer gets SIGPIPE, and under a caller's `set -o pipefail` the
    # pipeline fails although it matched.
    if [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) != "install ok installed" ]]; then
      printf '%s\n' "$pkg"
    fi
  done
}

# Prints "command package" for each row of tools.txt whose command is found now.
egret_present_tools() {
  local cmd pkg _
  [[ -r $EGRET_TOOLS_TABLE ]] || return 0
  while read -r cmd pkg _; do
    [[ -z $cmd || $cmd == \#* ]] && continue
    if command -v "$cmd" >/dev/null 2>&1; then printf '%s %s\n' "$cmd" "$pkg"; fi
  done <"$EGRET_TOOLS_TABLE"
}

# Prints "command package" for each row of tools.txt whose package is one of "$@".
egret_tools_of_pkgs() {
  local cmd pkg _ want
  [[ -r $EGRET_TOOLS_TABLE ]] || return 0
  while read -r cmd pkg _; do
    [[ -z $cmd || $cmd == \#* ]] && continue
    for want in "$@"; do
      if [[ ${want%%=*} == "$pkg" ]]; then printf '%s %s\n' "$cmd" "$pkg"; fi
    done
  done <"$EGRET_TOOLS_TABLE"
}

# The newest version of $1 that a configured archive carries (not the dpkg status
# file alone), or nothing.
egret_archive_version() {
  apt-cache madison "$1" 2>/dev/null | awk -F'|' 'NR == 1 { gsub(/ /, "", $2); print $2 }'
}

# Simulates installing "$@": succeeds when apt can solve the set and removes
# nothing; EGRET_PLAN_REMOVED holds what it would remove.
egret_plan_is_clean() {
  local plan
  EGRET_PLAN_REMOVED=()
  if ! plan=$(apt-get install -s -q --no-install-recommends --allow-downgrades "$@" 2>&1); then
    printf '%s\n' "$plan" | grep -E '^(E:| )' >&2 || true
    return 1
  fi
  # shellcheck disable=SC2207 # package names have no blanks
  EGRET_PLAN_REMOVED=($(printf '%s\n' "$plan" | awk '$1 == "Remv" { print $2 }'))
  ((${#EGRET_PLAN_REMOVED[@]} == 0))
}

# The source package of $1's archive candidate (binary packages built from one
# source must agree on their version).
egret_source_of() {
  apt-cache show --no-all-versions "$1" 2>/dev/null \
    | awk -v p="$1" '$1 == "Source:" { print $2; found = 1; exit } END { if (!found) print p }'
}

# Prints the set to ask for: the requested packages "$@" and the removed ones
# (EGRET_PLAN_REMOVED), with each installed package that no configured archive
# carries at its installed build pinned to the archive's newest version when apt
# would remove it, or when a package of its source is missing (QEMU's family).
egret_agreeing_set() {
  local pkg installed archive
  local -A new_sources=() removed=()
  for pkg in $(egret_missing_pkgs "$@"); do new_sources[$(egret_source_of "$pkg")]=1; done
  for pkg in "${EGRET_PLAN_REMOVED[@]}"; do removed[$pkg]=1; done
  for pkg in "$@" "${EGRET_PLAN_REMOVED[@]}"; do
    installed=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null || true)
    archive=$(egret_archive_version "$pkg")
    if [[ -n $installed && -n $archive ]] \
      && { [[ -n ${removed[$pkg]:-} ]] || [[ -n ${new_sources[$(dpkg-query -W -f='${source:Package}' "$pkg")]:-} ]]; } \
      && ! apt-cache madison "$pkg" | awk -F'|' -v v="$installed" '{ gsub(/ /, "", $2) } $2 == v { f = 1 } END { exit !f }'; then
      printf '%s=%s\n' "$pkg" "$archive"
    else
      printf '%s\n' "$pkg"
    fi
  done | sort -u
}

# Fails naming the command and package of each tools.txt row in "$1" (lines of
# "command package") that is not found now; $2 says after what.
egret_check_tools() {
  local rows=$1 after=$2 cmd pkg bad=0
  while read -r cmd pkg; do
    [[ -z $cmd ]] && continue
    # A command off PATH (Go lives in /usr/lib/go-1.19/bin) counts when its
    # package has it in a bin directory.
    if ! command -v "$cmd" >/dev/null 2>&1 \
      && ! dpkg -L "$pkg" 2>/dev/null | awk -v c="$cmd" '$0 ~ "/s?bin/" c "$" { f = 1 } END { exit !f }'; then
      echo "packages: after $after, the command $cmd (package $pkg) is missing" >&2
      bad=1
    fi
  done <<<"$rows"
  return "$bad"
}

# Installs the packages "$@" (see the top of this file).
egret_ensure_pkgs() {
  local -a missing
  mapfile -t missing < <(egret_missing_pkgs "$@")
  ((${#missing[@]} == 0)) && return 0
  # A dry run only simulates: no lock, and no need for root.
  if [[ ${EGRET_PKGS_DRY_RUN:-0} == 1 ]]; then
    egret_install_pkgs "$@"
    return
  fi
  # One installer at a time on the machine: tests/run.sh builds the API server
  # in the background while the image scripts install their packages, and apt
  # refuses a second transaction rather than waiting for the first. The lock
  # lives in a directory only root writes (not the world-writable /run/lock).
  mkdir -p /run/egret
  (
    flock 8 || exit 1
    egret_install_pkgs "$@"
  ) 8>/run/egret/packages.lock
}

# egret_ensure_pkgs's work, under its lock: what is missing is asked again,
# since another installer may have put it there while this one waited.
egret_install_pkgs() {
  local -a missing
  mapfile -t missing < <(egret_missing_pkgs "$@")
  ((${#missing[@]} == 0)) && return 0
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have no package lists, or old ones. Old lists can
  # solve the set and still name builds the archive has dropped (the
  # security archive replaces bpftool with each kernel update: a fetch meets
  # 404): apt-get install then fails, the lists are updated, and the
  # transaction is planned and run once more.
  local updated=0 rc=0
  if ! apt-get install -s -q --no-install-recommends "$@" >/dev/null 2>&1; then
    apt-get update -q >/dev/null
    updated=1
  fi
  egret_apt_transaction "${missing[*]}" "$@" || rc=$?
  if ((rc == EGRET_APT_FETCH_FAILED && !updated)); then
    echo "    packages: apt-get install failed with this machine's package lists; apt-get update, then once more"
    apt-get update -q >/dev/null
    rc=0
    egret_apt_transaction "${missing[*]}" "$@" || rc=$?
  fi
  return "$rc"
}

# What egret_apt_transaction returns when apt-get install itself failed.
EGRET_APT_FETCH_FAILED=3

# One planned transaction for the packages "${@:2}" ($1: the missing ones,
# for the message): 1 when apt would remove something, EGRET_APT_FETCH_FAILED
# when apt-get install failed, 2 when a command is missing after it.
egret_apt_transaction() {
  local -a set
  local before wanted missing=$1
  shift
  before=$(egret_present_tools)
  set=("$@")
  if ! egret_plan_is_clean "${set[@]}"; then
    local first="${EGRET_PLAN_REMOVED[*]}"
    mapfile -t set < <(egret_agreeing_set "${set[@]}" "${EGRET_PLAN_REMOVED[@]}")
    echo "    packages: apt would remove ${first:-nothing} or could not solve $*; asking for ${set[*]}"
    if ! egret_plan_is_clean "${set[@]}"; then
      # What stands in the way: what apt still removes, else the first
      # plan's removals that no archive version could replace.
      local removed="${EGRET_PLAN_REMOVED[*]}" pkg
      if [[ -z $removed ]]; then
        for pkg in $first; do
          [[ " ${set[*]} " == *" $pkg="* ]] || removed+="${removed:+ }$pkg"
        done
      fi
      echo "packages: cannot install $* without removing ${removed:-what apt names above}: install them by hand, in one apt-get install, at versions that agree" >&2
      return 1
    fi
  fi
  echo "    apt-get install ${set[*]} (missing: $missing)"
  if [[ ${EGRET_PKGS_DRY_RUN:-0} == 1 ]]; then return 0; fi
  apt-get install -y -q --no-install-recommends --allow-downgrades "${set[@]}" || return "$EGRET_APT_FETCH_FAILED"
  wanted=$(egret_tools_of_pkgs "${set[@]}")
  egret_check_tools "$(printf '%s\n%s\n' "$before" "$wanted" | sort -u)" "apt-get install ${set[*]}" || return 2
}
