#!/usr/bin/env bash
# The Vagrant lab end to end (vagrant/README.md), an opt-in step: not run by
# tests/run.sh (it takes several minutes under software emulation).
#
#   tests/vagrant.sh            node image (cached) -> egret/node box (cached)
#                               -> vagrant up -> egret-lab-check -> vagrant destroy
#   tests/vagrant.sh --keep     the same, but leave the VMs (and libvirtd) up
#
# Run as root from a clone. It installs Vagrant, vagrant-libvirt and libvirt
# from Debian, builds the node image if it is missing (`tests/image.sh node`;
# EGRET_BIN=<path> uses that egret), and starts virtlogd and libvirtd itself
# when none answers (machines without systemd), stopping them at the end.
# The lab's addresses are docs/lab.md's, inside the VMs; the host gets only
# the isolated management network 198.19.250.0/24 (bridge made by libvirt,
# removed by `vagrant destroy`). Fails if any pod's traffic does not leave
# as its policy says.
set -euo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
repo=$PWD

keep=0
case "${1:-}" in
  --keep) keep=1 ;;
  "") ;;
  -h | --help) sed -n '2,17p' "$self"; exit 0 ;;
  *) echo "vagrant.sh: unknown argument '$1' (--keep)" >&2; exit 2 ;;
esac
if ((EUID != 0)); then
  echo "vagrant.sh: run as root (libvirt, loop devices)" >&2
  exit 1
fi

# shellcheck source=tests/k8s/common.sh
. tests/k8s/common.sh
egret_ensure_pkgs vagrant vagrant-libvirt libvirt-daemon-system libvirt-clients qemu-system-x86 \
  qemu-utils dnsmasq-base procps

say() { printf '==> [vagrant] %s\n' "$*"; }

# libvirt: use the running daemons, or start them (and stop them at exit:
# after the VMs are destroyed, also on failure).
started=()
# libvirtd switches the host's IPv4 forwarding on when it starts networks;
# put it back as it was (new network namespaces inherit it on recent
# kernels, and tests that build their own routers expect it off).
forwarding=$(sysctl -n net.ipv4.ip_forward)
finish() {
  local status=$?
  set +e
  if ((!keep)); then
    say "vagrant destroy"
    if (cd "$repo/vagrant" && vagrant destroy -f) >/dev/null; then
      for ((i = ${#started[@]} - 1; i >= 0; i--)); do
        [[ -f ${started[i]} ]] && kill "$(cat "${started[i]}")"
      done
    elif ((${#started[@]})); then
      echo "vagrant.sh: vagrant destroy failed: libvirtd left running (cd vagrant && vagrant destroy -f)" >&2
    fi
    sysctl -qw "net.ipv4.ip_forward=$forwarding"
  fi
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT TERM
if ! virsh -c qemu:///system version >/dev/null 2>&1; then
  say "starting virtlogd and libvirtd"
  /usr/sbin/virtlogd --daemon --pid-file /run/egret-vagrant-virtlogd.pid
  started+=(/run/egret-vagrant-virtlogd.pid)
  /usr/sbin/libvirtd --daemon --pid-file /run/egret-vagrant-libvirtd.pid
  started+=(/run/egret-vagrant-libvirtd.pid)
  for _ in $(seq 100); do
    virsh -c qemu:///system version >/dev/null 2>&1 && break
    sleep 0.2
  done
  virsh -c qemu:///system version >/dev/null
fi
# vagrant-libvirt makes the storage pool "default" (not autostarted) at its
# first run; after a restart of libvirtd it must be started again.
if virsh -c qemu:///system pool-info default 2>/dev/null | grep -q '^State: *inactive'; then
  virsh -c qemu:///system pool-start default >/dev/null
fi
t0=$SECONDS
image=${EGRET_NODE_IMAGE:-${EGRET_CACHE:-/var/cache/egret}/images/node/egret-node.qcow2}
if [[ -z ${EGRET_NODE_IMAGE:-} ]]; then
  # Cached: returns at once when the image is up to date.
  tests/image.sh node
fi
[[ -f $image ]] || { echo "vagrant.sh: no node image at $image (tests/image.sh node)" >&2; exit 1; }
vagrant/build-box.sh
t_box=$((SECONDS - t0))


cd vagrant
say "vagrant up"
t1=$SECONDS
# Progress bars (redrawn after carriage returns) left out of the log; sed -u
# passes each line on at once.
if ! vagrant up --provider libvirt | sed -u 's/.*\r//'; then
  echo "vagrant.sh: vagrant up failed" >&2
  exit 1
fi
t_up=$((SECONDS - t1))

say "egret-lab-check (in the client VM)"
t2=$SECONDS
vagrant ssh client -c 'sudo egret-lab-check'
t_check=$((SECONDS - t2))
vagrant ssh gateway -c 'sudo egret status --socket /run/egret/egret.sock' || true
say "times: image+box ${t_box} s, vagrant up ${t_up} s, check ${t_check} s"
