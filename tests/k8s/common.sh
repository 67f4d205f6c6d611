# shellcheck shell=bash
# Shared settings of tests/k8s/build-apiserver.sh and tests/k8s/apiserver.sh: where the
# kube-apiserver built from Debian's source package is cached, and small helpers.
# Sourced, never run.
# shellcheck disable=SC2034 # the variables are used by the scripts that source this

# The Kubernetes release the API server is built from, and the exact Debian source
# package version that carries it (bookworm's `kubernetes` source package).
EGRET_KUBE_VERSION=1.20.2
EGRET_KUBE_DEB_VERSION=${EGRET_KUBE_DEB_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}

# The cache lives outside the clone so that fresh clones (CI) reuse it.
EGRET_CACHE=${EGRET_CACHE:-/var/cache/egret}
EGRET_KUBE_DIR=${EGRET_KUBE_DIR:-$EGRET_CACHE/kube-apiserver-$EGRET_KUBE_VERSION}
EGRET_KUBE_APISERVER_BIN=$EGRET_KUBE_DIR/kube-apiserver
EGRET_KUBECTL_BIN=$EGRET_KUBE_DIR/kubectl

# Debian packages needed to run the API server (etcd 3.4, openssl for keys, curl for
# the readiness probe).
EGRET_K8S_RUNTIME_PKGS=(etcd-server openssl curl ca-certificates)

# Prints the packages of "$@" that dpkg does not list as installed.
egret_missing_pkgs() {
  local pkg
  for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -qx 'install ok installed'; then
      printf '%s\n' "$pkg"
    fi
  done
}

# Installs the packages of "$@" that are missing; runs `apt-get update` only when the
# first attempt fails (stale or absent package lists on a fresh machine).
egret_ensure_pkgs() {
  local missing
  mapfile -t missing < <(egret_missing_pkgs "$@")
  [ "${#missing[@]}" -eq 0 ] && return 0
  echo "    apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
}
