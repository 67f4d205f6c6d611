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
EGRET_KUBE_PROXY_BIN=$EGRET_KUBE_DIR/kube-proxy

# Debian packages needed to run the API server (etcd 3.4, openssl for keys, curl for
# the readiness probe).
# conntrack and iptables for kube-proxy (it deletes stale UDP entries with conntrack).
EGRET_K8S_RUNTIME_PKGS=(etcd-server openssl curl ca-certificates conntrack iptables)

# egret_ensure_pkgs and egret_missing_pkgs: the one package installer (tests/packages.sh).
# shellcheck source=../packages.sh
source "$(dirname "${BASH_SOURCE[0]}")/../packages.sh"
