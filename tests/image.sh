#!/usr/bin/env bash
# Builds the images users deploy (docs/images.md):
#
#   tests/image.sh              both images
#   tests/image.sh container    the OCI container image (deploy/images/container/)
#   tests/image.sh node         the bootable gateway node image (deploy/images/node/)
#
# Run as root from a clone, with no container registry: the root file
# systems come from Debian's packages, through this machine's own apt
# sources. The slow parts (the Debian root file systems, the release build)
# are cached under ${EGRET_CACHE:-/var/cache/egret}/images/; a second run
# only adds what changed. Each build prints the path of what it made.
#
# EGRET_BIN=/path/to/egret uses that binary instead of a release build.
set -euo pipefail
cd "$(dirname "$0")/.."

if ((EUID != 0)); then
  echo "image.sh: run as root (debootstrap, loop devices)" >&2
  exit 1
fi

what=${1:-all}
case "$what" in
  container | node) targets=("$what") ;;
  all) targets=(container node) ;;
  -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
  *) echo "image.sh: unknown image '$what' (container, node or all)" >&2; exit 2 ;;
esac

tests/install-deps.sh >/dev/null
for t in "${targets[@]}"; do
  printf '\n==> image: %s\n' "$t"
  "deploy/images/$t/build.sh"
done
