#!/usr/bin/env bash
# Egret's lab: pods, a node router, the gateway, an upstream router and an
# external server in network namespaces on this machine (docs/lab.md).
#
#   tests/lab.sh                 install, build, bring the lab up, show what the
#                                server sees from each pod next to the gateway's
#                                sessions and counters, tear everything down
#   tests/lab.sh --keep          the same, but leave the lab up to explore
#   tests/lab.sh down            remove a lab left up
#   extra options (after --keep or alone): --one-arm, --server-mtu N
#
# Run as root from a clone. Only TEST-NET/benchmark addresses, only inside
# namespaces named egret-lab-*; nothing touches the host's own interfaces.
set -euo pipefail

cd "$(dirname "$0")/.."
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
lab_bin="$target_dir/release/egret-lab"

keep=0
up_args=()
while (($#)); do
  case "$1" in
    --keep) keep=1 ;;
    --one-arm) up_args+=(--one-arm) ;;
    --server-mtu) up_args+=(--server-mtu "$2"); shift ;;
    down)
      if [[ -x $lab_bin ]]; then
        exec "$lab_bin" down
      fi
      # No binary (never built): remove the namespaces by name.
      for ns in $(ip netns list | awk '$1 ~ /^egret-lab-/ {print $1}'); do
        for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
      done
      rm -rf /run/egret-lab
      exit 0
      ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "lab.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if ((EUID != 0)); then
  echo "lab.sh: run as root (network namespaces, XDP, raw sockets)" >&2
  exit 1
fi

tests/install-deps.sh
if ! command -v cargo >/dev/null; then
  echo "lab.sh: cargo not found; install Rust (https://rustup.rs) and re-run" >&2
  exit 1
fi
echo "lab.sh: building (release)"
cargo build --release -p egret-controlplane -p egret-tests

if ((!keep)); then
  # Always tear down: on success, on error, on Ctrl-C.
  trap '"$lab_bin" down' EXIT
  trap 'exit 130' INT TERM
fi

"$lab_bin" up "${up_args[@]}"
status=0
"$lab_bin" demo || status=$?

if ((keep)); then
  cat <<EOF

The lab stays up. Explore it:
  ip netns list | grep egret-lab-                      the namespaces
  ip netns exec egret-lab-pod-a curl -s http://198.51.100.7/
                                                       the server answers "saw <source it saw>"
  ip netns exec egret-lab-pod-u curl -s http://198.51.100.7/   an unselected pod: untouched
  ip netns exec egret-lab-pod-v6 curl -s 'http://[2001:db8:51::7]/'
  $target_dir/release/egret sessions --socket /run/egret-lab/egret.sock
  $target_dir/release/egret counters --json --socket /run/egret-lab/egret.sock
  ip -n egret-lab-gw link show                         XDP attached to inside/outside
  ip netns exec egret-lab-up tcpdump -ni gw            the outside link
  cat /run/egret-lab/egret.yaml /run/egret-lab/egret.log
Remove it with: tests/lab.sh down
EOF
fi
exit "$status"
