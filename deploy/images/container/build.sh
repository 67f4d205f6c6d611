#!/usr/bin/env bash
# Builds the gateway's OCI image (README.md beside this file) with no
# container registry and no daemon:
#
#   1. a Debian bookworm root from Debian's packages (debootstrap, minbase,
#      plus nftables and libelf1), through the mirror this machine's own apt
#      sources name; cached by its inputs;
#   2. a minimal root: egret, nft, the libraries both load (as the Debian
#      root's ldd resolves them), Debian's CA bundle, /etc/passwd, /etc/group, /etc/nsswitch.conf,
#      the Debian copyright files and dpkg status entries of the packages
#      those files come from (for licence compliance and vulnerability
#      scanners), and the mount points the DaemonSet uses;
#   3. `buildah bud --isolation chroot` of the `FROM scratch` Containerfile,
#      in a private vfs store, with every timestamp set to 0 (the same inputs
#      give the same digest), written as an OCI layout and an oci-archive.
#
# Output: ${EGRET_CACHE:-/var/cache/egret}/images/container/current/
#   oci/                     OCI image layout, tag egret:<version>
#   egret-<version>.oci.tar  the same as an oci-archive
#                            (skopeo copy oci-archive:... docker://...,
#                            ctr -n k8s.io images import ...)
#   digest                   the manifest's digest
#   egret.debug              the binary's debug information (the image's
#                            copy has it stripped)
#   packages                 the Debian packages the image's files come from
# and prints both paths and the digest.
#
# EGRET_BIN=/path/to/egret uses that binary; without it this runs
# `cargo build --release --locked -p egret-controlplane --bin egret`.
# Run as root (debootstrap, chroot). The image is rebuilt only when the
# binary, this script, the Containerfile or the Debian root changed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
# shellcheck source-path=SCRIPTDIR/../../..
# shellcheck source=tests/k8s/common.sh
source "$repo/tests/k8s/common.sh"

SUITE=bookworm
# Packages on top of minbase: nft and the libraries egret links (libelf;
# zlib, libgcc and libc are in minbase already), and Debian's CA bundle for
# the cloud providers' TLS (the AWS SDK reads the system's roots).
BASE_PKGS=(nftables libelf1 ca-certificates)
# What the build itself runs. runc and umoci are for tests/tests/container_image.rs
# (which calls this script first), golang-github-containers-common for the
# seccomp profile that test converts.
BUILD_PKGS=(binutils debootstrap buildah umoci runc golang-github-containers-common debian-archive-keyring python3)
CACHE=${EGRET_CACHE:-/var/cache/egret}/images/container

log() { printf '    %s\n' "$*"; }
die() { printf 'container image: %s\n' "$*" >&2; exit 1; }

((EUID == 0)) || die "run as root (debootstrap and chroot need it)"
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9
# Under the lock: two builds at once would race for dpkg's lock.
egret_ensure_pkgs "${BUILD_PKGS[@]}"

# The Debian mirror, read from this machine's apt sources (deb822
# /etc/apt/sources.list.d/*.sources, else one-line /etc/apt/sources.list):
# the first `deb` source that carries $SUITE's main component.
mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    awk -v suite="$SUITE" '
      function flush() {
        if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && (" " comps " ") ~ / main /) {
          split(uris, u, " "); print u[1]; found = 1; exit
        }
        types = ""; suites = ""; comps = ""; uris = ""
      }
      /^[[:space:]]*$/ { flush(); next }
      /^#/ { next }
      /^Types:/ { sub(/^Types:[[:space:]]*/, ""); types = $0 }
      /^Suites:/ { sub(/^Suites:[[:space:]]*/, ""); suites = $0 }
      /^Components:/ { sub(/^Components:[[:space:]]*/, ""); comps = $0 }
      /^URIs:/ { sub(/^URIs:[[:space:]]*/, ""); uris = $0 }
      END { if (!found) flush() }
    ' "$f" | head -n1 | grep . && return 0
  done
  if [[ -r /etc/apt/sources.list ]]; then
    # deb [options] URI suite components...
    awk -v suite="$SUITE" '$1 == "deb" {
        i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
        if ($(i + 1) == suite) { for (j = i + 2; j <= NF; j++) if ($j == "main") { print $i; exit } }
      }' /etc/apt/sources.list | grep . && return 0
  fi
  return 1
}

# The Debian root the image's files come from. Its cache key hashes this
# function's own text (the recipe) and the package list.
build_base() {
  local dest=$1 url
  url=$(mirror) || die "no Debian $SUITE mirror in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list"
  log "debootstrap --variant=minbase $SUITE from $url"
  debootstrap --variant=minbase --include="$(IFS=,; echo "${BASE_PKGS[*]}")" \
    "$SUITE" "$dest" "$url" >"$dest.log" 2>&1 || { tail -n 20 "$dest.log" >&2; die "debootstrap failed (log $dest.log)"; }
  # apt's downloaded .debs are not needed again.
  rm -rf "$dest"/var/cache/apt/archives/*.deb "$dest"/var/lib/apt/lists/*_Packages
}

# Copies the file the Debian root `base` has at `path` into `dest`, as
# Debian lays it out: the file itself at its real path (merged /usr: /lib is
# a link to usr/lib), and the name asked for as a link to it when it is one.
copy_from_base() {
  local base=$1 dest=$2 path=$3 real dir
  real=$(chroot "$base" readlink -f "$path")
  (cd "$base" && cp -a --parents ".$real" "$dest")
  dir=$(chroot "$base" readlink -f "$(dirname "$path")")
  if [[ "$dir/$(basename "$path")" != "$real" ]]; then
    (cd "$base" && cp -a --parents ".$dir/$(basename "$path")" "$dest")
  fi
}

# The minimal root: egret at /usr/bin/egret, nft, their libraries.
assemble_root() {
  local base=$1 egret=$2 dest=$3 scratch libs l pkgs p
  mkdir -p "$dest"
  # Debian's top-level links (bin -> usr/bin, lib -> usr/lib, lib64, sbin).
  for l in bin lib lib32 lib64 libx32 sbin; do
    [[ -L $base/$l ]] && cp -a "$base/$l" "$dest/$l"
  done
  install -D -m 0755 "$egret" "$dest/usr/bin/egret"
  copy_from_base "$base" "$dest" /usr/sbin/nft

  # The libraries, as the Debian root's own loader resolves them. egret is
  # placed in the root's /tmp for the moment of the ldd.
  scratch=$(mktemp -d "$base/tmp/egret-ldd.XXXXXX")
  cp "$egret" "$scratch/egret"
  libs=$(chroot "$base" ldd "${scratch#"$base"}/egret" /usr/sbin/nft) || { rm -rf "$scratch"; die "ldd in the Debian root failed"; }
  rm -rf "$scratch"
  if grep -q 'not found' <<<"$libs"; then
    die "libraries missing from the Debian root (add their packages to BASE_PKGS):
$(grep 'not found' <<<"$libs")"
  fi
  # `name => /path (addr)` and the loader's bare `/path (addr)`.
  mapfile -t libs < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// && $1 !~ /:$/ { print $1 }' <<<"$libs" | sort -u)
  ((${#libs[@]} > 0)) || die "ldd in the Debian root listed no library"
  for l in "${libs[@]}"; do
    copy_from_base "$base" "$dest" "$l"
  done

  # Debian's CA bundle, as update-ca-certificates generated it in the root
  # (the file no package owns; ca-certificates is named below). Where
  # openssl-probe, and so rustls-native-certs, look first.
  [[ -s $base/etc/ssl/certs/ca-certificates.crt ]] || die "the Debian root has no /etc/ssl/certs/ca-certificates.crt"
  install -D -m 0644 "$base/etc/ssl/certs/ca-certificates.crt" "$dest/etc/ssl/certs/ca-certificates.crt"

  # The packages those files come from: their copyright files and dpkg
  # status entries (one file per package, as distroless images do, which
  # scanners such as trivy and grype read).
  mapfile -t pkgs < <(
    {
      for l in /usr/sbin/nft "${libs[@]}"; do
        chroot "$base" dpkg-query -S "$(chroot "$base" readlink -f "$l")" 2>/dev/null ||
          chroot "$base" dpkg-query -S "$l" 2>/dev/null || true
      done | cut -d: -f1
      echo ca-certificates
    } | sort -u
  )
  mkdir -p "$dest/var/lib/dpkg/status.d"
  for p in "${pkgs[@]}"; do
    chroot "$base" dpkg-query -s "$p" >"$dest/var/lib/dpkg/status.d/$p"
    if [[ -e $base/usr/share/doc/$p/copyright ]]; then
      install -D -m 0644 "$base/usr/share/doc/$p/copyright" "$dest/usr/share/doc/$p/copyright"
    fi
  done
  printf '%s\n' "${pkgs[@]}" >"$dest.packages"

  # Accounts (the gateway runs as root: it needs the capabilities, and
  # runAsNonRoot would take them away without ambient capabilities), name
  # service (files only; the Kubernetes client connects to the API server
  # by the address the kubeconfig or the in-cluster variables give, DNS
  # through glibc's built-in resolver).
  mkdir -p "$dest/etc" "$dest/etc/egret" "$dest/run/egret" "$dest/proc" "$dest/sys" "$dest/dev" "$dest/tmp" "$dest/root"
  chmod 1777 "$dest/tmp"
  chmod 0700 "$dest/root"
  printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$dest/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$dest/etc/group"
  printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$dest/etc/nsswitch.conf"
  cp -L "$base/etc/os-release" "$dest/etc/os-release"
  # Every file dated 0, like the image's layer (reproducible).
  find "$dest" -exec touch -h -d @0 {} +
}

egret_bin() {
  if [[ -n ${EGRET_BIN:-} ]]; then
    [[ -x $EGRET_BIN ]] || die "EGRET_BIN=$EGRET_BIN is not an executable"
    printf '%s\n' "$EGRET_BIN"
    return
  fi
  local target=${CARGO_TARGET_DIR:-$repo/target}
  log "cargo build --release --locked -p egret-controlplane --bin egret" >&2
  (cd "$repo" && cargo build --release --locked -p egret-controlplane --bin egret) >&2
  printf '%s\n' "$target/release/egret"
}

started=$(date +%s)
# Absolute: the image is assembled from another directory.
bin=$(readlink -f "$(egret_bin)")
version=$("$bin" --version | awk '{ print $2 }')
[[ -n $version ]] || die "$bin --version printed no version"

# 1. The Debian root.
base_key=$( { echo "$SUITE minbase ${BASE_PKGS[*]}"; declare -f build_base; } | sha256sum | cut -c1-16)
base=$CACHE/base-$base_key
if [[ ! -d $base ]]; then
  rm -rf --one-file-system "$base.tmp" "$base.tmp.log"
  mkdir -p "$base.tmp"
  build_base "$base.tmp"
  mv "$base.tmp.log" "$base.log"
  mv "$base.tmp" "$base"
  # One cached copy: older roots go.
  find "$CACHE" -maxdepth 1 -name 'base-*' ! -name "base-$base_key*" -exec rm -rf --one-file-system {} +
  log "Debian root: $base (built in $(($(date +%s) - started)) s)"
else
  log "Debian root: $base (cached)"
fi

# 2-3. The image.
image_key=$( { echo "$base_key"; sha256sum <"$bin"; cat "$here/build.sh" "$here/Containerfile"; } | sha256sum | cut -c1-16)
out=$CACHE/image-$image_key
if [[ ! -d $out ]]; then
  work=$(mktemp -d "$CACHE/work.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  # The release profile keeps line tables for backtraces (95 MB); the image
  # gets the binary without them (symbols stay, so a backtrace still names
  # functions), and they are kept beside the image, linked by build id and
  # debuglink: `gdb -s egret.debug` or addr2line -e egret.debug.
  (
    cd "$work"
    objcopy --only-keep-debug "$bin" egret.debug
    strip --strip-debug -o egret "$bin"
    objcopy --add-gnu-debuglink=egret.debug egret
  )
  log "assembling the root: egret $version, nft, their libraries"
  assemble_root "$base" "$work/egret" "$work/ctx/rootfs"
  cp "$here/Containerfile" "$work/ctx/Containerfile"
  mv "$work/ctx/rootfs.packages" "$work/packages"

  store=(--root "$work/storage" --runroot "$work/run" --storage-driver vfs)
  printf '{"default": [{"type": "insecureAcceptAnything"}]}\n' >"$work/policy.json"
  log "buildah bud --isolation chroot (vfs store in $work)"
  buildah "${store[@]}" bud --quiet --isolation chroot --timestamp 0 \
    --signature-policy "$work/policy.json" \
    --label "org.opencontainers.image.title=egret" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.description=Egret Kubernetes egress gateway" \
    -f "$work/ctx/Containerfile" -t "localhost/egret:$version" "$work/ctx" >"$work/bud.log" 2>&1 ||
    { cat "$work/bud.log" >&2; die "buildah bud failed"; }
  mkdir -p "$work/out"
  buildah "${store[@]}" push --quiet --signature-policy "$work/policy.json" \
    "localhost/egret:$version" "oci:$work/out/oci:egret:$version"
  buildah "${store[@]}" push --quiet --signature-policy "$work/policy.json" \
    "localhost/egret:$version" "oci-archive:$work/out/egret-$version.oci.tar:egret:$version"
  python3 - "$work/out/oci/index.json" >"$work/out/digest" <<'EOF'
import json, sys
print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])
EOF
  mv "$work/packages" "$work/out/packages"
  mv "$work/egret.debug" "$work/out/egret.debug"
  mv "$work/out" "$out"
  ln -sfn "image-$image_key" "$CACHE/current.tmp"
  mv -T "$CACHE/current.tmp" "$CACHE/current"
  find "$CACHE" -maxdepth 1 -name 'image-*' ! -name "image-$image_key" -exec rm -rf {} +
  log "built in $(($(date +%s) - started)) s"
else
  ln -sfn "image-$image_key" "$CACHE/current.tmp"
  mv -T "$CACHE/current.tmp" "$CACHE/current"
  log "image cached"
fi

echo "OCI layout:  $out/oci (egret:$version)"
echo "oci-archive: $out/egret-$version.oci.tar"
echo "digest:      $(cat "$out/digest")"
