#!/usr/bin/env bash
# Installs moto (`moto[server]`, pinned in tests/moto/common.sh) into a Python
# virtual environment cached outside the clone, for the AWS provider's tests
# (tests/tests/cloud_aws.rs, through tests/moto/moto.sh).
#
# Idempotent: a virtual environment that already has the pinned version is
# reused (a second run costs one Python start). Needs python3 with venv; on
# Debian, python3-venv is installed with apt-get when missing (as root).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$here/common.sh"

log() { printf '[moto/install.sh] %s\n' "$*" >&2 || true; }
die() { log "ERROR: $*"; exit 1; }

venv=$EGRET_MOTO_VENV
want=$EGRET_MOTO_VERSION

installed_version() {
  [ -x "$venv/bin/python" ] || return 1
  "$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("moto"))' 2>/dev/null
}

present() {
  [ -f "$venv/.egret-complete" ] && [ "$(installed_version || true)" = "$want" ] && [ -x "$EGRET_MOTO_SERVER_BIN" ]
}

if present; then
  log "moto $want present in $venv"
  exit 0
fi

# One installer at a time: the README's two commands run side by side both
# come here on a fresh machine, and each would remove the other's half-built
# environment. The second waits, then finds the first's complete.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if present; then
  log "moto $want present in $venv (installed while this one waited)"
  exit 0
fi

command -v python3 >/dev/null || die "python3 not found: install the python3 package (tests/install-deps.sh)"
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  # Debian splits venv's pip bootstrap into python3-venv.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "apt-get install python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends python3-venv \
      || { apt-get update && apt-get install -y -q --no-install-recommends python3-venv; } \
      || die "cannot install python3-venv (needed to create $venv)"
  else
    die "python3 cannot create virtual environments: install python3-venv (as root: apt-get install python3-venv)"
  fi
fi

# A virtual environment cannot be moved (its scripts name their interpreter by
# absolute path), so it is built in place and marked complete at the end: an
# interrupted install has no marker and is rebuilt.
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
log "creating $venv for moto[server]==$want"
python3 -m venv "$venv" || die "python3 -m venv $venv failed"
if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "moto[server]==$want"; then
  rm -rf "$venv"
  die "pip could not install the package moto[server]==$want (is PyPI reachable? python3 >= 3.9?)"
fi
[ "$(installed_version || true)" = "$want" ] || die "moto $want not importable from $venv after install"
[ -x "$EGRET_MOTO_SERVER_BIN" ] || die "no moto_server in $venv/bin after installing moto[server]==$want"
touch "$venv/.egret-complete"
log "moto $want installed in $venv"
