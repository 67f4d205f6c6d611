#!/usr/bin/env bash
# Installs what Egret's build, lab and tests need on a Debian bookworm machine.
# Idempotent: packages already present are skipped, so a second run costs a
# few dpkg queries. Run as root.
#
# Two lists:
# - every command the tests and scripts run, with its package, is in
#   tests/tools.txt; this script installs the packages that file names it
#   for (tests/tests/tools_table.rs checks that the file lists every command
#   the sources run, and that each one is there after this script);
# - what only the build needs, below: the XDP program (clang, llvm, libelf,
#   zlib, pkg-config, m4 for libbpf-sys's vendored build, the kernel's UAPI
#   headers) and bpftool for inspecting maps; for looking around by hand,
#   psmisc (fuser, killall) and tcpdump (docs/lab.md).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
table=$here/tools.txt

BUILD_PACKAGES=(clang llvm libelf-dev zlib1g-dev pkg-config m4 bpftool linux-libc-dev psmisc tcpdump)

if [[ ! -r $table ]]; then
  echo "install-deps: $table not found (run from a clone of the repository)" >&2
  exit 1
fi
# Column 2 (the package) of the rows whose column 3 is this script.
mapfile -t TOOL_PACKAGES < <(awk '!/^[[:space:]]*(#|$)/ && $3 == "tests/install-deps.sh" { print $2 }' "$table" | sort -u)
if ((${#TOOL_PACKAGES[@]} == 0)); then
  echo "install-deps: no package in $table is marked tests/install-deps.sh: the table is damaged" >&2
  exit 1
fi
PACKAGES=("${BUILD_PACKAGES[@]}" "${TOOL_PACKAGES[@]}")

# shellcheck source=packages.sh
source "$here/packages.sh"
if egret_ensure_pkgs "${PACKAGES[@]}"; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
else
  exit 1
fi

# moto's EC2 API emulator for the AWS provider's tests (tests/moto/install.sh:
# a pinned moto[server] in a cached virtual environment; idempotent).
"$here/moto/install.sh"
