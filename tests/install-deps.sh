#!/usr/bin/env bash
# Installs what Egret's build, lab and tests need on a Debian bookworm machine.
# Idempotent: packages already present are skipped, so a second run costs a
# few dpkg queries. Run as root.
set -euo pipefail

# Build: the XDP program (clang, llvm, libelf, zlib, pkg-config, m4 for
# libbpf-sys's vendored build) and bpftool for inspecting maps.
# Lab and tests: iproute2 (netns, veth), ethtool (offload settings),
# nftables (the kernel SNAT baseline of the throughput benchmark), tcpdump
# (captures in failing tests), curl (HTTP through the gateway), socat.
PACKAGES=(
  clang llvm libelf-dev zlib1g-dev pkg-config m4 bpftool linux-libc-dev
  iproute2 ethtool nftables tcpdump curl socat procps psmisc
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${missing[@]}"; then
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
  fi
else
  echo "install-deps: all ${#PACKAGES[@]} packages present"
fi
