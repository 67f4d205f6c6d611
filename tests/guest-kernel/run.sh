#!/usr/bin/env bash
# Runs a command on Debian bookworm's Linux 6.1, the oldest kernel Egret
# supports (the kernel of bookworm and of the Vagrant lab), in a virtual
# machine:
#
#   tests/guest-kernel/run.sh [--cpus N] [--memory MiB] [--timeout S] -- COMMAND...
#
# The guest's root is this machine's root, read-only, under a tmpfs overlay
# (the guest's writes vanish with it), so binaries built here run there
# unchanged: only the kernel differs. COMMAND runs as root in the current
# directory with RUST_* and EGRET_* passed through; the script exits with
# its status (124 when the machine timed out).
#
# The kernel package (the newest linux-image-6.1.0-N-amd64 apt knows, or
# $EGRET_GUEST_KERNEL_PKG), its modules and the initramfs are cached under
# ${EGRET_CACHE:-/var/cache/egret}/guest-kernel/. The machine is emulated
# (QEMU TCG): this machine kind exposes /dev/kvm but no VMX to its guests,
# and a KVM guest hangs before the kernel starts. Set EGRET_GUEST_ACCEL=kvm
# where nested virtualisation works. Under TCG a test that loads the XDP
# program once took about 10x as long as here (2.6 s against 0.2-0.3 s), so
# timing-sensitive tests do not belong in the guest.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cpus=2 memory=4096 timeout_s=3600
while (($#)); do
  case "$1" in
    --cpus) cpus=$2; shift 2 ;;
    --memory) memory=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--cpus N] [--memory MiB] [--timeout S] -- COMMAND..." >&2; exit 2 ;;
  esac
done
(($#)) || { echo "usage: $0 [--cpus N] [--memory MiB] [--timeout S] -- COMMAND..." >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "guest-kernel: must run as root" >&2; exit 1; }

# shellcheck source=../k8s/common.sh
source "$here/../k8s/common.sh" # EGRET_CACHE, egret_ensure_pkgs
egret_ensure_pkgs qemu-system-x86 busybox-static cpio kmod xz-utils

say() { printf '==> [guest-kernel] %s\n' "$*"; }

# --- the kernel ---------------------------------------------------------
pkg=${EGRET_GUEST_KERNEL_PKG:-}
newest_61() { apt-cache pkgnames linux-image-6.1.0- | grep -E '^linux-image-6\.1\.0-[0-9]+-amd64$' | sort -V | tail -n 1; }
if [[ -z $pkg ]]; then
  pkg=$(newest_61 || true)
  if [[ -z $pkg ]]; then
    apt-get update -q >/dev/null
    pkg=$(newest_61)
  fi
fi
kver=${pkg#linux-image-}
dir=$EGRET_CACHE/guest-kernel/$pkg
mkdir -p "$EGRET_CACHE/guest-kernel"
exec 9>"$EGRET_CACHE/guest-kernel/.lock"
flock 9
if [[ ! -f $dir/root/boot/vmlinuz-$kver || ! -f $dir/root/lib/modules/$kver/modules.dep ]]; then
  say "fetching $pkg"
  rm -rf "$dir" && mkdir -p "$dir/deb"
  (cd "$dir/deb" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >/dev/null)
  dpkg-deb -x "$dir"/deb/*.deb "$dir/root"
  rm -rf "$dir/deb"
  depmod -b "$dir/root" "$kver"
fi

# --- the initramfs: busybox, virtio + 9p + overlay modules, our init -----
recipe=$( (cat "$here/initramfs-init" "$here/run.sh"; command -v busybox; echo "$kver") | sha256sum | cut -d' ' -f1)
if [[ ! -f $dir/initrd.gz || $(cat "$dir/initrd.recipe" 2>/dev/null) != "$recipe" ]]; then
  say "building the initramfs"
  work=$(mktemp -d)
  mkdir -p "$work"/{bin,mods,proc,sys,dev,lower,rw,newroot}
  cp "$(command -v busybox)" "$work/bin/busybox"
  cp "$here/initramfs-init" "$work/init"
  : > "$work/egret-modules"
  # Dependencies first, each module once, as modprobe would load them.
  for m in virtio_pci 9pnet_virtio 9p overlay; do
    modprobe -d "$dir/root" -S "$kver" --show-depends "$m"
  done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' | while read -r ko; do
      name=$(basename "$ko"); name=${name%.xz}; name=${name%.ko}
      case "$ko" in
        *.xz) xz -dc "$ko" > "$work/mods/$name.ko" ;;
        *) cp "$ko" "$work/mods/$name.ko" ;;
      esac
      echo "$name" >> "$work/egret-modules"
    done
  (cd "$work" && find . | cpio -o -H newc --quiet | gzip -1) > "$dir/initrd.gz.new"
  mv "$dir/initrd.gz.new" "$dir/initrd.gz"
  echo "$recipe" > "$dir/initrd.recipe"
  rm -rf "$work"
fi
flock -u 9

# --- the run -------------------------------------------------------------
out=$(mktemp -d /var/tmp/egret-guest.XXXXXX)
trap '[[ -n ${EGRET_GUEST_KEEP:-} ]] || rm -rf "$out"' EXIT
printf '%q ' "$@" > "$out/cmd"
pwd > "$out/cwd"
env | grep -E '^(RUST_|EGRET_)[A-Za-z0-9_]*=' > "$out/env" || true
accel=${EGRET_GUEST_ACCEL:-tcg,thread=multi}
cpu=max
[[ $accel == kvm* ]] && cpu=host
say "Linux $kver, $cpus CPUs, $memory MiB, accel $accel: $*"
set +e
timeout "$timeout_s" qemu-system-x86_64 -accel "$accel" -cpu "$cpu" -smp "$cpus" -m "$memory" \
  -nographic -no-reboot -kernel "$dir/root/boot/vmlinuz-$kver" -initrd "$dir/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 egret.init=$here/guest-init.sh" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs "local,path=$dir/root/lib/modules,mount_tag=modules,security_model=none,readonly=on" \
  -virtfs "local,path=$out,mount_tag=out,security_model=none" 2>&1 |
  tee "$out/console" | sed -u -e 's/\r$//' -e '0,/guest: Linux/{/guest: Linux/!d; s/.*\(guest: Linux\)/\1/}'
machine=${PIPESTATUS[0]}
set -e
if [[ ! -f $out/rc ]]; then
  if [[ $machine -eq 124 ]]; then
    echo "guest-kernel: the machine did not finish within $timeout_s s" >&2
  else
    echo "guest-kernel: the machine stopped before the command finished; its console ended with:" >&2
  fi
  tail -n 40 "$out/console" >&2
  exit $((machine == 124 ? 124 : 1))
fi
exit "$(cat "$out/rc")"
