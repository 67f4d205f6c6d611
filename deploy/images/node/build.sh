#!/usr/bin/env bash
# Builds the bootable gateway node image (deploy/images/node/README.md):
# Debian bookworm, Linux 6.1, systemd, the fail-closed boot table, egret as a
# systemd unit, extlinux in the MBR; one BIOS-bootable disk.
#
#   deploy/images/node/build.sh        (as root; tests/image.sh node runs it)
#
# Prints the path of the image: ${EGRET_CACHE:-/var/cache/egret}/images/node/
# egret-node.qcow2 (a stable path; EGRET_NODE_RAW=1 also keeps egret-node.raw).
# The Debian root (debootstrap, the slow part) is cached under the same
# directory, keyed by mkroot.sh and packages.txt; the image is rebuilt only
# when the root, the egret binary, rootfs/ or this script changed.
#
# EGRET_BIN=/path/to/egret puts that binary in the image; without it, this
# runs `cargo build --release --locked -p egret-controlplane --bin egret`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
# shellcheck source=../../../tests/k8s/common.sh
source "$repo/tests/k8s/common.sh" # EGRET_CACHE, egret_ensure_pkgs

say() { printf '==> [node image] %s\n' "$*"; }
((EUID == 0)) || { echo "node image: run as root (debootstrap, loop devices, mount)" >&2; exit 1; }
# Also the boot test's (tests/tests/node_image.rs runs this first): QEMU and
# the config drive's vfat tools.
egret_ensure_pkgs debootstrap extlinux syslinux-common qemu-utils e2fsprogs fdisk util-linux mount coreutils systemd binutils \
  qemu-system-x86 dosfstools mtools

cache=$EGRET_CACHE/images/node
mkdir -p "$cache"
exec 8>"$cache/.lock"
flock 8

# --- the egret binary ------------------------------------------------------
if [[ -n ${EGRET_BIN:-} ]]; then
  bin=$EGRET_BIN
else
  say "cargo build --release --locked -p egret-controlplane --bin egret"
  (cd "$repo" && cargo build --release --locked -p egret-controlplane --bin egret)
  bin=${CARGO_TARGET_DIR:-$repo/target}/release/egret
fi
[[ -x $bin ]] || { echo "node image: no egret binary at $bin" >&2; exit 1; }
bin=$(readlink -f "$bin")

# --- the Debian root, cached by its inputs ----------------------------------
root_key=$(cat "$here/mkroot.sh" "$here/packages.txt" | sha256sum | cut -c1-16)
root=$cache/root-$root_key
if [[ ! -f $root/.complete ]]; then
  # One cached root: an older key's root is removed (disk is shared).
  rm -rf --one-file-system "$cache"/root-*
  started=$SECONDS
  "$here/mkroot.sh" "$root.tmp"
  touch "$root.tmp/.complete"
  mv "$root.tmp" "$root"
  say "root built in $((SECONDS - started)) s"
else
  say "root $root (cached)"
fi

# --- the image, cached by everything that goes into it ----------------------
out=$cache/egret-node.qcow2
image_key=$({
  echo "$root_key"
  sha256sum <"$bin"
  cat "$here/build.sh"
  (cd "$here/rootfs" && find . -type f -o -type l | LC_ALL=C sort | while read -r f; do
    echo "$f $(stat -c %a "$f")"
    if [[ -L $f ]]; then readlink "$f"; else cat "$f"; fi
  done)
} | sha256sum | cut -c1-16)
if [[ -f $out && $(cat "$cache/egret-node.key" 2>/dev/null) == "$image_key" ]]; then
  say "image $out (cached, key $image_key)"
  echo "$out"
  exit 0
fi

started=$SECONDS
work=$(mktemp -d "$cache/build.XXXXXX")
mnt=$work/mnt
loop=
cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then umount -R "$mnt" || true; fi
  if [[ -n $loop ]]; then losetup -d "$loop" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

raw=$work/egret-node.raw
size=${EGRET_NODE_IMAGE_SIZE:-2G}
truncate -s "$size" "$raw"
# One bootable primary partition from 1 MiB: the MBR's code boots the active
# partition's extlinux.
printf 'label: dos\nstart=2048, type=83, bootable\n' | sfdisk -q "$raw"
offset=$((2048 * 512))
raw_size=$(stat -c %s "$raw")
loop=$(losetup --find --show --offset "$offset" --sizelimit "$((raw_size - offset))" "$raw")
# extlinux 6.04 cannot read ext4's 64bit layout.
mkfs.ext4 -q -L egret-root -O ^64bit "$loop"
uuid=$(blkid -s UUID -o value "$loop")
mkdir "$mnt"
mount "$loop" "$mnt"

say "copying the root"
cp -a "$root/." "$mnt/"
rm -f "$mnt/.complete"
# The image's own files: units, scripts, sysctls, defaults.
cp -a "$here/rootfs/." "$mnt/"
# Without debug info (95 MB -> 22 MB for a release build); the symbols stay,
# so backtraces still name functions.
objcopy --strip-debug "$bin" "$work/egret"
install -m 0755 "$work/egret" "$mnt/usr/bin/egret"
mkdir -p "$mnt/etc/egret"

# First-boot identity: systemd makes a machine-id, sshd its host keys.
: >"$mnt/etc/machine-id"
rm -f "$mnt"/etc/ssh/ssh_host_*
echo egret-node >"$mnt/etc/hostname"
printf 'UUID=%s / ext4 errors=remount-ro 0 1\n' "$uuid" >"$mnt/etc/fstab"
systemctl --root="$mnt" enable systemd-networkd.service ssh.service \
  egret-config-drive.service egret-failclosed-boot.service egret-nic-setup.service \
  egret.service egret-ready-report.service >/dev/null 2>&1

# The boot loader: extlinux in the partition, syslinux's MBR code in front.
kver=$(find "$mnt/boot" -maxdepth 1 -name 'vmlinuz-*' -printf '%f\n' | sed 's/^vmlinuz-//' | sort -V | tail -n 1)
[[ -n $kver && -f $mnt/boot/initrd.img-$kver ]] || { echo "node image: no kernel/initrd in the root's /boot" >&2; exit 1; }
mkdir -p "$mnt/boot/extlinux"
cat >"$mnt/boot/extlinux/extlinux.conf" <<EOF
SERIAL 0 115200
DEFAULT egret
TIMEOUT 0
PROMPT 0
LABEL egret
  LINUX /boot/vmlinuz-$kver
  INITRD /boot/initrd.img-$kver
  APPEND root=UUID=$uuid ro console=tty0 console=ttyS0,115200n8 net.ifnames=0 no_timer_check
EOF
extlinux --install "$mnt/boot/extlinux" >/dev/null
umount "$mnt"
losetup -d "$loop"
loop=
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$raw" bs=440 count=1 conv=notrunc status=none

# Compressed clusters: about a third of the size, for some 20 s here.
qemu-img convert -c -O qcow2 "$raw" "$work/egret-node.qcow2"
mv "$work/egret-node.qcow2" "$out"
if [[ ${EGRET_NODE_RAW:-0} == 1 ]]; then
  mv "$raw" "$cache/egret-node.raw"
else
  rm -f "$cache/egret-node.raw"
fi
echo "$image_key" >"$cache/egret-node.key"
say "image built in $((SECONDS - started)) s: $(du -h --apparent-size "$out" | cut -f1) ($(du -h "$out" | cut -f1) on disk), kernel $kver, key $image_key"
echo "$out"
