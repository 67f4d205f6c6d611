#!/usr/bin/env bash
# Builds tests/helm-render (Helm's template engine: Go's text/template + sprig,
# main.go) with Debian's Go 1.19 and Go libraries, in GOPATH mode (no module
# proxy, nothing downloaded but Debian packages), and caches the binary outside
# the clone:
#
#   ${EGRET_CACHE:-/var/cache/egret}/helm-render/<key>/helm-render
#
# <key> hashes main.go, this script and the installed versions of the Go
# packages: an unchanged renderer is never rebuilt, a changed one replaces the
# cached copy (only one is kept). Prints the binary's path on stdout (the only
# line there); progress goes to stderr. Run as root the first time (it installs
# the packages with apt-get).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=../k8s/common.sh
source "$here/../k8s/common.sh"

go_bin=/usr/lib/go-1.19/bin
# Go, sprig v3 (with its dependencies) and a YAML library with
# sigs.k8s.io/yaml's behaviour (ghodss/yaml, its ancestor, over yaml.v2).
pkgs=(golang-1.19-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev golang-gopkg-yaml.v2-dev)

egret_ensure_pkgs "${pkgs[@]}" >&2

key=$(
  {
    cat "$here/main.go" "$here/build.sh"
    dpkg-query -W -f='${Package} ${Version}\n' "${pkgs[@]}"
  } | sha256sum | cut -c1-16
)
cache=$EGRET_CACHE/helm-render
bin=$cache/$key/helm-render
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [ -x "$bin" ]; then # built by another run while this one waited
  echo "$bin"
  exit 0
fi

tmp=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
echo "==> [helm-render] building $bin" >&2
mkdir -p "$tmp/gopath/src/helm-render" "$tmp/out"
cp "$here/main.go" "$tmp/gopath/src/helm-render/"
# GOPATH mode: Debian installs Go libraries under /usr/share/gocode/src.
(
  export PATH=$go_bin:$PATH GO111MODULE=off GOPATH=$tmp/gopath:/usr/share/gocode \
    GOCACHE=$tmp/gocache CGO_ENABLED=0 GOFLAGS=
  go build -trimpath -o "$tmp/out/helm-render" helm-render
)
# Only one cached copy: older keys (and builds a killed run left) go.
find "$cache" -mindepth 1 -maxdepth 1 -type d ! -path "$tmp" -exec rm -rf {} +
mv "$tmp/out" "$cache/$key"
echo "    built in $((SECONDS - start)) s" >&2
echo "$bin"
