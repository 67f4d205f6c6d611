#!/usr/bin/env bash
# Turns the gateway node image (deploy/images/node/, built by
# `tests/image.sh node`) into a Vagrant box for the libvirt provider and
# adds it as `egret/node`, so that `vagrant up` in vagrant/ needs nothing
# from the internet (vagrant/README.md).
#
#   vagrant/build-box.sh            build (cached) and `vagrant box add` it
#   vagrant/build-box.sh --no-add   build only; prints the box file's path
#
# Input: EGRET_NODE_IMAGE, default ${EGRET_CACHE:-/var/cache/egret}/images/node/egret-node.qcow2.
# Output: ${EGRET_CACHE}/images/vagrant/egret-node-<key>.box, keyed by the
# input image, this script, box-Vagrantfile and Vagrant's key; a second run
# with the same inputs only checks that the box is added.
#
# The box is a copy of the node image with what Vagrant needs and a
# production node does not: a `vagrant` user holding Vagrant's well-known
# insecure public key (Vagrant swaps it for a fresh key pair at the first
# `vagrant up`), password-less sudo for it, sshd, DHCP on the management
# NIC (the one at PCI 00:05.0, where the box's Vagrantfile puts it), and
# `no_timer_check panic=10` on the kernel command line (TCG). Packages the image lacks (openssh-server, sudo, rsync, socat) are
# installed from this machine's own apt sources. Run as root.
set -euo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."

if ((EUID != 0)); then
  echo "build-box.sh: run as root (loop devices, mount, chroot)" >&2
  exit 1
fi
add=1
case "${1:-}" in
  --no-add) add=0 ;;
  "") ;;
  -h | --help) sed -n '2,21p' "$self"; exit 0 ;;
  *) echo "build-box.sh: unknown argument '$1' (--no-add)" >&2; exit 2 ;;
esac

# shellcheck source=tests/k8s/common.sh
. tests/k8s/common.sh
egret_ensure_pkgs qemu-utils util-linux fdisk mount e2fsprogs coreutils tar vagrant vagrant-libvirt

EGRET_CACHE=${EGRET_CACHE:-/var/cache/egret}
image=${EGRET_NODE_IMAGE:-$EGRET_CACHE/images/node/egret-node.qcow2}
if [[ ! -f $image ]]; then
  echo "build-box.sh: no node image at $image: build it with 'tests/image.sh node'" >&2
  echo "  (or point EGRET_NODE_IMAGE at one)" >&2
  exit 1
fi
box_name=egret/node
out_dir=$EGRET_CACHE/images/vagrant
mkdir -p "$out_dir"

# The packages the box adds if the image lacks them: sshd for `vagrant ssh`
# and provisioning, sudo for the provisioners, rsync for `vagrant rsync`,
# socat for the lab's client VM (its server and clients).
box_pkgs=(openssh-server sudo rsync socat)

# Vagrant's insecure public key, as Debian's vagrant package ships it.
vagrant_pub=$(dpkg -L vagrant | grep -m1 '/keys/vagrant\.pub$' || true)
if [[ -z $vagrant_pub || ! -f $vagrant_pub ]]; then
  echo "build-box.sh: the vagrant package has no keys/vagrant.pub (dpkg -L vagrant)" >&2
  exit 1
fi

exec 9>"$out_dir/.lock"
flock 9
# The node image's build holds its directory's lock while it writes the
# image: read it under that lock.
if [[ -f $(dirname "$image")/.lock ]]; then
  exec 8<"$(dirname "$image")/.lock"
  flock -s 8
fi

echo "build-box.sh: hashing $image"
key=$( (sha256sum <"$image" | cut -d' ' -f1; cat "$self" vagrant/box-Vagrantfile "$vagrant_pub") | sha256sum | cut -c1-16)
box=$out_dir/egret-node-$key.box

build_box() {
  local work
  work=$(mktemp -d "$out_dir/build.XXXXXX")
  local loop="" mnt=$work/root
  local -a bound=()
  cleanup() {
    for ((i = ${#bound[@]} - 1; i >= 0; i--)); do umount "${bound[i]}" 2>/dev/null || true; done
    mountpoint -q "$mnt" && umount "$mnt"
    [[ -n $loop ]] && losetup -d "$loop" 2>/dev/null
    rm -rf "$work"
  }
  trap cleanup EXIT

  echo "build-box.sh: copying the image (raw, sparse)"
  qemu-img convert -O raw "$image" "$work/disk.raw"

  # The root file system: the partition that holds /etc/os-release (or the
  # whole disk if it has no partition table).
  local -a parts=()
  mapfile -t parts < <(sfdisk --dump "$work/disk.raw" 2>/dev/null |
    sed -n 's/.*start= *\([0-9]*\), *size= *\([0-9]*\).*/\1 \2/p')
  ((${#parts[@]})) || parts=("0 0")
  mkdir -p "$mnt"
  local p start size found=0
  for p in "${parts[@]}"; do
    read -r start size <<<"$p"
    if ((size)); then
      loop=$(losetup --find --show --offset $((start * 512)) --sizelimit $((size * 512)) "$work/disk.raw")
    else
      loop=$(losetup --find --show "$work/disk.raw")
    fi
    if mount "$loop" "$mnt" 2>/dev/null; then
      if [[ -f $mnt/etc/os-release ]]; then
        found=1
        break
      fi
      umount "$mnt"
    fi
    losetup -d "$loop"
    loop=""
  done
  if ((!found)); then
    echo "build-box.sh: no partition of $image holds a root file system (/etc/os-release)" >&2
    exit 1
  fi
  echo "build-box.sh: root file system found ($(sed -n 's/^PRETTY_NAME=//p' "$mnt/etc/os-release"))"

  for p in proc sys dev dev/pts; do
    mount --bind "/$p" "$mnt/$p"
    bound+=("$mnt/$p")
  done

  # Packages the image lacks, from this machine's own apt sources (copied
  # into a scratch directory; the image's /etc/apt is left as it is).
  local -a missing=()
  for p in "${box_pkgs[@]}"; do
    # shellcheck disable=SC2016 # dpkg-query's format, not the shell's
    chroot "$mnt" dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -qx 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    local apt_dir=$mnt/var/tmp/egret-box-apt
    mkdir -p "$apt_dir/sources.list.d" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    cp /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list "$apt_dir/sources.list.d/" 2>/dev/null || true
    if [[ -f /etc/apt/sources.list ]]; then
      cp /etc/apt/sources.list "$apt_dir/sources.list"
    else
      : >"$apt_dir/sources.list"
    fi
    if ! grep -qsE '^(URIs:|deb )' "$apt_dir/sources.list" "$apt_dir"/sources.list.d/*; then
      echo "build-box.sh: this machine has no apt sources (/etc/apt/sources.list{,.d}) to install ${missing[*]} from" >&2
      exit 1
    fi
    local resolv_backup=""
    if [[ -e $mnt/etc/resolv.conf || -L $mnt/etc/resolv.conf ]]; then
      resolv_backup=$work/resolv.conf
      cp -a "$mnt/etc/resolv.conf" "$resolv_backup"
      rm -f "$mnt/etc/resolv.conf"
    fi
    cp /etc/resolv.conf "$mnt/etc/resolv.conf"
    local -a apt_opts=(-o Dir::Etc::SourceList=/var/tmp/egret-box-apt/sources.list
      -o Dir::Etc::SourceParts=/var/tmp/egret-box-apt/sources.list.d
      -o Dir::State::Lists=/var/tmp/egret-box-apt/lists
      -o Dir::Cache=/var/tmp/egret-box-apt/cache)
    echo "build-box.sh: installing ${missing[*]} into the box"
    chroot "$mnt" apt-get "${apt_opts[@]}" -q update >/dev/null
    DEBIAN_FRONTEND=noninteractive chroot "$mnt" apt-get "${apt_opts[@]}" -q -y \
      --no-install-recommends install "${missing[@]}" >/dev/null
    rm -rf "$apt_dir"
    rm -f "$mnt/etc/resolv.conf"
    [[ -n $resolv_backup ]] && cp -a "$resolv_backup" "$mnt/etc/resolv.conf"
  fi

  # The vagrant user, its insecure key and sudo.
  chroot "$mnt" id vagrant >/dev/null 2>&1 || chroot "$mnt" useradd -m -s /bin/bash -U vagrant
  install -d -m 700 "$mnt/home/vagrant/.ssh"
  install -m 600 "$vagrant_pub" "$mnt/home/vagrant/.ssh/authorized_keys"
  chroot "$mnt" chown -R vagrant:vagrant /home/vagrant/.ssh
  printf 'vagrant ALL=(ALL) NOPASSWD: ALL\nDefaults:vagrant !requiretty\n' >"$mnt/etc/sudoers.d/vagrant"
  chmod 440 "$mnt/etc/sudoers.d/vagrant"

  # sshd at boot, without reverse DNS lookups (there is no DNS on the lab's
  # management network). An image without host keys gets them made at the
  # first start, before Debian's `sshd -t` check (which fails without them).
  mkdir -p "$mnt/etc/ssh/sshd_config.d" "$mnt/etc/systemd/system/ssh.service.d"
  echo 'UseDNS no' >"$mnt/etc/ssh/sshd_config.d/vagrant.conf"
  cat >"$mnt/etc/systemd/system/ssh.service.d/vagrant-host-keys.conf" <<'EOF'
# Added by Egret's vagrant/build-box.sh: host keys before `sshd -t`.
[Service]
ExecStartPre=
ExecStartPre=/usr/bin/ssh-keygen -A
ExecStartPre=/usr/sbin/sshd -t
EOF
  chroot "$mnt" systemctl enable ssh.service >/dev/null 2>&1

  # DHCP on the management NIC only: the box's Vagrantfile pins it at PCI
  # 00:05.0; the other NICs are the lab's, configured by provisioning.
  mkdir -p "$mnt/etc/systemd/network"
  cat >"$mnt/etc/systemd/network/10-vagrant-mgmt.network" <<'EOF'
# Added by Egret's vagrant/build-box.sh: Vagrant's management NIC.
[Match]
Path=pci-0000:00:05.0

[Network]
DHCP=ipv4
LinkLocalAddressing=no
IPv6AcceptRA=no
EOF
  chroot "$mnt" systemctl enable systemd-networkd.service >/dev/null 2>&1

  # Under TCG on a busy host the kernel's boot-time check of the IO-APIC
  # timer fails now and then: "Kernel panic - not syncing: IO-APIC + timer
  # doesn't work", and the VM hangs there (once in about a dozen boots here).
  # Skip that check, as cloud images do, and reboot 10 s after a panic.
  local boot_conf=$mnt/boot/extlinux/extlinux.conf
  if [[ -f $boot_conf ]]; then
    sed -i -E '/^[[:space:]]*APPEND /{/no_timer_check/!s/$/ no_timer_check/;/panic=/!s/$/ panic=10/}' "$boot_conf"
    echo "build-box.sh: kernel command line:$(sed -n 's/^[[:space:]]*APPEND//p' "$boot_conf")"
  else
    echo "build-box.sh: no /boot/extlinux/extlinux.conf in the image: its kernel command line is left as it is" >&2
  fi

  # Each VM made from the box is a machine of its own: a fresh machine-id
  # at first boot (it also keys the DHCP client identifier: two VMs with one
  # machine-id would get one address).
  : >"$mnt/etc/machine-id"
  rm -f "$mnt/var/lib/dbus/machine-id"

  for ((i = ${#bound[@]} - 1; i >= 0; i--)); do umount "${bound[i]}"; done
  bound=()
  umount "$mnt"
  losetup -d "$loop"
  loop=""

  echo "build-box.sh: writing the box"
  mkdir -p "$work/box"
  qemu-img convert -O qcow2 "$work/disk.raw" "$work/box/box.img"
  rm -f "$work/disk.raw"
  local bytes gib
  bytes=$(qemu-img info --output=json "$work/box/box.img" | sed -n 's/.*"virtual-size": *\([0-9]*\).*/\1/p')
  gib=$(((bytes + (1 << 30) - 1) >> 30))
  printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %d}\n' "$gib" >"$work/box/metadata.json"
  cp vagrant/box-Vagrantfile "$work/box/Vagrantfile"
  tar -C "$work/box" -cf "$work/box.tar" metadata.json Vagrantfile box.img
  mv "$work/box.tar" "$box"
  trap - EXIT
  cleanup
}

if [[ ! -f $box ]]; then
  start=$(date +%s)
  build_box
  echo "build-box.sh: built $box in $(($(date +%s) - start)) s"
  # Older boxes of other inputs: keep only this one.
  find "$out_dir" -maxdepth 1 -name 'egret-node-*.box' ! -path "$box" -delete
fi
exec 8<&-

if ((!add)); then
  echo "$box"
  exit 0
fi

# Add it unless this very box is the one added. vagrant-libvirt copies a
# box's image into the libvirt storage pool at the first `vagrant up` and
# never refreshes that copy: a re-added box must drop it.
added=$out_dir/added-key
if [[ $(cat "$added" 2>/dev/null) == "$key" ]] && vagrant box list 2>/dev/null | grep -q "^$box_name .*libvirt"; then
  echo "build-box.sh: $box_name is up to date ($box)"
  exit 0
fi
# (Its progress bar, redrawn after carriage returns, left out.)
vagrant box add --force --name "$box_name" "$box" | sed -u 's/.*\r//'
if virsh -c qemu:///system vol-list default >/dev/null 2>&1; then
  for vol in $(virsh -c qemu:///system vol-list default | awk '$1 ~ /^egret-VAGRANTSLASH-node_vagrant_box_image/ {print $1}'); do
    virsh -c qemu:///system vol-delete --pool default "$vol" >/dev/null
  done
else
  echo "build-box.sh: libvirtd does not answer: delete the old box's copy, if any, once it runs" >&2
  echo "  (virsh -c qemu:///system vol-list default: egret-VAGRANTSLASH-node_vagrant_box_image_*)" >&2
fi
echo "$key" >"$added"
echo "build-box.sh: added $box_name from $box"
