#!/usr/bin/env bash
# Builds kube-apiserver, kube-proxy (and kubectl) 1.20.2 for Egret's integration tests from Debian
# bookworm's `kubernetes` source package (which vendors all Go dependencies) with
# Debian's Go 1.19, and caches them outside the clone:
#
#   ${EGRET_CACHE:-/var/cache/egret}/kube-apiserver-1.20.2/{kube-apiserver,kube-proxy,kubectl,inputs,build-times}
#
# kube-proxy runs in the Kubernetes labs' gateway and worker-node namespaces
# (tests/src/kubeproxy.rs), in iptables mode, as a cluster runs it.
#
# Idempotent: when the binaries exist and the recorded inputs (this script and
# common.sh less their comments, the source package version, the installed Go and
# reflect2 package versions, whether kubectl is wanted) match, it only checks that the
# packages are installed and exits. It rebuilds when a binary is missing or an input
# changed. A cold build takes about 10 minutes on 2 cores and peaks at 1.3 GB RSS.
#
# Usage: tests/k8s/build-apiserver.sh [--force]
# Environment:
#   EGRET_CACHE             cache root (default /var/cache/egret)
#   EGRET_BUILD_KUBECTL=0   skip kubectl (default: build it, about a minute more)
#   EGRET_KEEP_BUILD=1      keep the unpacked source tree and Go cache after a build
#
# /etc/apt is never modified: the source package is fetched with private copies of the
# machine's apt sources turned into deb-src entries.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$here/common.sh"

force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

build_kubectl=${EGRET_BUILD_KUBECTL:-1}
work=$EGRET_CACHE/build-kubernetes-$EGRET_KUBE_VERSION
go_pkg=golang-1.19-go
go_bin=/usr/lib/go-1.19/bin
reflect2_pkg=golang-github-modern-go-reflect2-dev
reflect2_src=/usr/share/gocode/src/github.com/modern-go/reflect2
build_pkgs=("$go_pkg" "$reflect2_pkg" dpkg-dev make rsync)

current_step="start"
step() {
  current_step=$1
  printf '==> [build-apiserver] %s\n' "$1"
}
on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    printf '!!! [build-apiserver] FAILED (exit %s) during step: %s\n' "$rc" "$current_step" >&2
    printf '!!! [build-apiserver] work directory kept for inspection: %s\n' "$work" >&2
  fi
}
trap on_exit EXIT

if [ "$(id -u)" -ne 0 ]; then
  echo "build-apiserver: must run as root (it installs Debian packages)" >&2
  exit 1
fi

step "lock $EGRET_KUBE_DIR"
mkdir -p "$EGRET_KUBE_DIR"
exec 9>"$EGRET_KUBE_DIR/.lock"
flock 9

step "install packages: ${EGRET_K8S_RUNTIME_PKGS[*]} ${build_pkgs[*]}"
egret_ensure_pkgs "${EGRET_K8S_RUNTIME_PKGS[@]}" "${build_pkgs[@]}"

pkg_version() { dpkg-query -W -f='${Version}' "$1"; }
inputs() {
  # The recipe is this script and common.sh without their comment lines: editing a
  # comment does not cost a rebuild.
  printf 'recipe-sha256 %s\n' "$(cat "$here/build-apiserver.sh" "$here/common.sh" | grep -v '^[[:space:]]*#' | sha256sum | cut -d' ' -f1)"
  printf 'kubernetes-source %s\n' "$EGRET_KUBE_DEB_VERSION"
  printf '%s %s\n' "$go_pkg" "$(pkg_version "$go_pkg")"
  printf '%s %s\n' "$reflect2_pkg" "$(pkg_version "$reflect2_pkg")"
  printf 'kubectl %s\n' "$build_kubectl"
}
wanted_inputs=$(inputs)

step "check cache $EGRET_KUBE_DIR"
up_to_date=1
reason=""
if [ "$force" = 1 ]; then
  up_to_date=0; reason="--force"
elif [ ! -x "$EGRET_KUBE_APISERVER_BIN" ]; then
  up_to_date=0; reason="no $EGRET_KUBE_APISERVER_BIN"
elif [ ! -x "$EGRET_KUBE_PROXY_BIN" ]; then
  up_to_date=0; reason="no $EGRET_KUBE_PROXY_BIN"
elif [ "$build_kubectl" = 1 ] && [ ! -x "$EGRET_KUBECTL_BIN" ]; then
  up_to_date=0; reason="no $EGRET_KUBECTL_BIN"
elif [ "$(cat "$EGRET_KUBE_DIR/inputs" 2>/dev/null)" != "$wanted_inputs" ]; then
  up_to_date=0; reason="recorded inputs differ"
fi
if [ "$up_to_date" = 1 ]; then
  echo "    up to date: $EGRET_KUBE_APISERVER_BIN"
  [ -f "$EGRET_KUBE_DIR/build-times" ] && sed 's/^/    last build: /' "$EGRET_KUBE_DIR/build-times"
  current_step="done"
  exit 0
fi
echo "    rebuilding: $reason"
total_start=$SECONDS

step "prepare work directory $work"
rm -rf "$work" "$EGRET_KUBE_DIR/inputs"
apt_dir=$work/apt
mkdir -p "$apt_dir/sources.list.d" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$work/src"

step "write private deb-src entries from the machine's apt sources"
# deb822 files: `Types: deb` (or `deb deb-src`) becomes `Types: deb-src`.
for f in /etc/apt/sources.list.d/*.sources; do
  [ -e "$f" ] || continue
  sed -E 's/^Types:.*$/Types: deb-src/' "$f" >"$apt_dir/sources.list.d/$(basename "$f")"
done
# One-line format: `deb ...` becomes `deb-src ...`.
: >"$apt_dir/sources.list"
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
  [ -e "$f" ] || continue
  sed -nE 's/^[[:space:]]*deb[[:space:]]+/deb-src /p' "$f" >>"$apt_dir/sources.list"
done
if [ -z "$(cat "$apt_dir/sources.list.d/"* "$apt_dir/sources.list" 2>/dev/null)" ]; then
  echo "no apt sources found in /etc/apt to derive deb-src entries from" >&2
  exit 1
fi
apt_opts=(
  -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
  -o "Dir::Etc::SourceList=$apt_dir/sources.list"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache"
  -o "APT::Sandbox::User=root"
)

step "apt-get update (private source lists)"
# A third-party repository without source indexes makes `update` fail; what matters is
# that Debian's kubernetes source is found afterwards.
apt-get "${apt_opts[@]}" -q update || echo "    apt-get update reported errors; checking for the source package anyway"

step "find kubernetes=$EGRET_KUBE_DEB_VERSION in the source indexes"
if ! apt-cache "${apt_opts[@]}" showsrc kubernetes 2>/dev/null | grep -qx "Version: $EGRET_KUBE_DEB_VERSION"; then
  echo "source package kubernetes=$EGRET_KUBE_DEB_VERSION not found; versions available:" >&2
  apt-cache "${apt_opts[@]}" showsrc kubernetes 2>/dev/null | grep '^Version:' >&2 || true
  exit 1
fi

step "apt-get source kubernetes=$EGRET_KUBE_DEB_VERSION"
(cd "$work/src" && apt-get "${apt_opts[@]}" -q source "kubernetes=$EGRET_KUBE_DEB_VERSION")
tree=$(find "$work/src" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
if [ -z "$tree" ] || [ ! -f "$tree/cmd/kube-apiserver/apiserver.go" ]; then
  echo "unpacked source tree not found under $work/src" >&2
  exit 1
fi
echo "    source tree: $tree"

step "replace vendored github.com/modern-go/reflect2 with Debian's $(pkg_version "$reflect2_pkg")"
# reflect2 v1.0.1 segfaults under Go >= 1.18 (on the first custom-resource watch);
# 1.0.2 has the fix (go_above_118.go). Only the package's .go and .s files are copied.
vendored=$tree/vendor/github.com/modern-go/reflect2
[ -d "$vendored" ] || { echo "no vendored reflect2 at $vendored" >&2; exit 1; }
[ -f "$reflect2_src/go_above_118.go" ] || { echo "$reflect2_src lacks go_above_118.go: not reflect2 >= 1.0.2" >&2; exit 1; }
find "$vendored" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) -delete
find "$reflect2_src" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
  -exec cp {} "$vendored/" \;

export PATH=$go_bin:$PATH
export CGO_ENABLED=0
echo "    $(go version)"

step "make WHAT=cmd/kube-apiserver (CGO_ENABLED=0)"
t0=$SECONDS
(cd "$tree" && make WHAT=cmd/kube-apiserver)
apiserver_seconds=$((SECONDS - t0))
echo "    kube-apiserver built in ${apiserver_seconds}s"

step "make WHAT=cmd/kube-proxy (CGO_ENABLED=0)"
t0=$SECONDS
(cd "$tree" && make WHAT=cmd/kube-proxy)
proxy_seconds=$((SECONDS - t0))
echo "    kube-proxy built in ${proxy_seconds}s"

kubectl_seconds=skipped
if [ "$build_kubectl" = 1 ]; then
  step "make WHAT=cmd/kubectl (CGO_ENABLED=0)"
  t0=$SECONDS
  (cd "$tree" && make WHAT=cmd/kubectl)
  kubectl_seconds=$((SECONDS - t0))
  echo "    kubectl built in ${kubectl_seconds}s"
fi

step "install into $EGRET_KUBE_DIR"
install -m 0755 "$tree/_output/bin/kube-apiserver" "$EGRET_KUBE_APISERVER_BIN.new"
mv -f "$EGRET_KUBE_APISERVER_BIN.new" "$EGRET_KUBE_APISERVER_BIN"
install -m 0755 "$tree/_output/bin/kube-proxy" "$EGRET_KUBE_PROXY_BIN.new"
mv -f "$EGRET_KUBE_PROXY_BIN.new" "$EGRET_KUBE_PROXY_BIN"
if [ "$build_kubectl" = 1 ]; then
  install -m 0755 "$tree/_output/bin/kubectl" "$EGRET_KUBECTL_BIN.new"
  mv -f "$EGRET_KUBECTL_BIN.new" "$EGRET_KUBECTL_BIN"
fi
"$EGRET_KUBE_APISERVER_BIN" --version
total_seconds=$((SECONDS - total_start))
{
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "total_seconds $total_seconds"
  echo "kube_apiserver_seconds $apiserver_seconds"
  echo "kube_proxy_seconds $proxy_seconds"
  echo "kubectl_seconds $kubectl_seconds"
  echo "cores $(nproc)"
} >"$EGRET_KUBE_DIR/build-times"
# Written last: a build that stopped half-way is never taken as up to date.
printf '%s\n' "$wanted_inputs" >"$EGRET_KUBE_DIR/inputs"

if [ "${EGRET_KEEP_BUILD:-0}" != 1 ]; then
  step "remove work directory $work"
  rm -rf "$work"
fi
current_step="done"
echo "==> [build-apiserver] done in ${total_seconds}s: $EGRET_KUBE_APISERVER_BIN"
