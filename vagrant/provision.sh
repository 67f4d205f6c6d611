#!/usr/bin/env bash
# Provisions the Vagrant lab machine (vagrant/Vagrantfile), as root inside
# it: the packages Egret's build, lab and tests need (tests/install-deps.sh),
# Rust for root through rustup, and the release build the lab runs, so that
# `sudo -i /egret/tests/lab.sh` starts at once. Safe to run again
# (`vagrant provision`): every step skips what is already there.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

apt-get update -q
# A C toolchain for Rust's linker and the crates that build C; curl for rustup.
apt-get install -y -q --no-install-recommends ca-certificates curl gcc libc6-dev git rsync
/egret/tests/install-deps.sh

if [[ ! -x /root/.cargo/bin/cargo ]]; then
  # The default profile brings clippy and rustfmt, which tests/run.sh uses.
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile default
fi
# shellcheck source=/dev/null
. /root/.cargo/env

cd /egret
cargo build --release -p egret-controlplane -p egret-tests
echo "provision: done. Try: vagrant ssh -c 'sudo -i /egret/tests/lab.sh'"
