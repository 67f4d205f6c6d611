#!/usr/bin/env bash
# Builds the gateway node image's Debian bookworm root file system with
# debootstrap into DIR (a new directory), from the mirror this machine's own
# apt sources name:
#
#   deploy/images/node/mkroot.sh DIR
#
# Called by build.sh, which caches DIR by the hash of this script and
# packages.txt: a new egret binary or unit file never reruns it.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
(($# == 1)) || { echo "usage: deploy/images/node/mkroot.sh DIR" >&2; exit 2; }
dir=$1
[[ ! -e $dir ]] || { echo "mkroot.sh: $dir exists" >&2; exit 1; }

# The Debian mirror of this machine's apt sources (never a name written here):
# the first deb822 `URIs:` of a stanza whose suites include bookworm, else the
# first `deb URI bookworm` line of sources.list.
mirror() {
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    uri=$(awk 'BEGIN { RS = ""; FS = "\n" }
      /(^|\n)Types:[^\n]*deb([ \t]|$|\n)/ && /(^|\n)Suites:[^\n]*[ \t]bookworm([ \t]|$|\n)/ {
        for (i = 1; i <= NF; i++) if ($i ~ /^URIs:/) { split($i, a, /[ \t]+/); print a[2]; exit } }' "$f")
    [[ -n $uri ]] && { echo "$uri"; return 0; }
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { if ($(i+1) == "bookworm") { print $i; exit } break } }' "$f")
    [[ -n $uri ]] && { echo "$uri"; return 0; }
  done
  return 1
}
uri=$(mirror) || {
  echo "mkroot.sh: no Debian bookworm mirror in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list" >&2
  exit 1
}
pkgs=$(grep -v -E '^[[:space:]]*(#|$)' "$here/packages.txt" | paste -sd, -)
echo "==> [node image] debootstrap bookworm from $uri: minbase + $pkgs"
debootstrap --variant=minbase --include="$pkgs" bookworm "$dir" "$uri"

# Apt inside the image uses the same mirror (and the security suite if the
# machine has one), so `apt-get install` works on a node.
{
  echo "deb $uri bookworm main"
  echo "deb $uri bookworm-updates main"
} >"$dir/etc/apt/sources.list"
chroot "$dir" apt-get clean
rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin
echo "==> [node image] root: $(du -sh "$dir" | cut -f1)"
