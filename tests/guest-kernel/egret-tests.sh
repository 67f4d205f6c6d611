#!/usr/bin/env bash
# The tests that depend on the kernel, run on Debian bookworm's Linux 6.1 in
# the emulated machine of tests/guest-kernel/run.sh: the step "the XDP
# program and AF_XDP on Linux 6.1" of tests/run.sh.
#
#   tests/guest-kernel/egret-tests.sh      # as root, after the workspace's tests were built
#
# The binaries are the debug test binaries cargo built here; each runs in its
# package's directory, two tests at a time (see `threads` below). Skipped on
# a machine that runs 6.1 itself, whose own test step already covered it.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ $(uname -r) == 6.1.* ]]; then
  echo "guest-kernel: this machine runs Linux $(uname -r) itself; the test step above covered 6.1"
  exit 0
fi

# What runs, per test binary (target name, then libtest arguments). Chosen
# for what the kernel decides: the verifier (every program load), the JIT,
# BPF_PROG_TEST_RUN, XDP attach through bpf_link, AF_XDP sockets, veth's
# XDP, netlink. Left out, with the reason:
# - steering `fixture_table` and `fixture_table_through_an_empty_fast_path`
#   (`--skip fixture_table` matches both): each loads the program 49 times
#   (once per fixture the program keeps state for, once for the rest), at
#   5 s each under emulation (4 min); every rule it covers is also met by
#   the other steering tests and by fast_path's fixture table;
# - xsk_veth `tiny_rings_under_a_flood_never_overrun_then_traffic_resumes`:
#   it first checks that its flood outran the worker, and an emulated sender
#   sometimes does not (1 run in 2 here); a precondition of its scenario,
#   not something the kernel decides;
# - the Kubernetes tests (k8s_*, apiserver_smoke): they exercise the
#   apiserver and the control plane, which do not depend on the kernel;
# - the measurement tests (ignored everywhere);
# - of the lab's end-to-end tests (about 25 s each here), the userspace twin
#   of each fast-path test but the first, and the 10,000-flow test: the
#   AF_XDP path is the same code under both, and the list below meets every
#   kernel feature the gateway uses (XDP_TX, bpf_redirect, partial checksums,
#   the fail-closed nftables rules, bpf_link detach on SIGKILL).
e2e=(
  traffic::translates_tcp_udp_icmp_two_arm::fast_path
  traffic::translates_tcp_udp_icmp_two_arm::userspace
  traffic::translates_tcp_udp_icmp_one_arm::fast_path
  ipv6::ipv6_udp_tcp_icmpv6_leave_as_e6::fast_path
  fastpath::checksums_right_at_the_server_tx_offload_on
  fastpath::established_flows_survive_a_next_hop_mac_change::fast_path
  fastpath::reload_removing_an_egress_ip_stops_its_offloaded_flows::fast_path
  inbound::arp_answered_for_owned_egress_ips_only
  inbound::unsolicited_inbound_dropped_service_port_reaches_kernel::fast_path
  pmtu::icmp_frag_needed_reaches_the_pod::fast_path
  malformed::malformed_frames_counted_gateway_keeps_forwarding::fast_path
  restart::sigkill_detaches_xdp_and_restart_recovers::fast_path
  restart::dead_gateway_does_not_leak::fast_path
)
plan=(
  "egret_bpf|"
  "steering|--skip fixture_table"
  "fast_path|"
  "decap|"
  "attach|"
  "xsk_veth|--skip tiny_rings_under_a_flood_never_overrun_then_traffic_resumes"
  "netlink|"
  "daemon_smoke|"
  "fastpath_fixtures|"
  "lab_topology|"
  "e2e|--exact $(printf '%s ' "${e2e[@]}")"
)
# EGRET_GUEST_ONLY="fast_path e2e" runs only those entries of the plan.
if [[ -n ${EGRET_GUEST_ONLY:-} ]]; then
  chosen=()
  for entry in "${plan[@]}"; do
    [[ " $EGRET_GUEST_ONLY " == *" ${entry%%|*} "* ]] && chosen+=("$entry")
  done
  if ((${#chosen[@]} == 0)); then
    echo "guest-kernel: EGRET_GUEST_ONLY=\"$EGRET_GUEST_ONLY\" names no entry of the plan (${plan[*]%%|*})" >&2
    exit 2
  fi
  plan=("${chosen[@]}")
fi
# Each binary runs its tests two at a time, as the test step runs them on
# this machine: the guest has two virtual CPUs, one host thread each, and a
# test that loads programs or waits on a lab leaves its CPU idle. One at a
# time, the four longest binaries took 690 s of a CI run's 882-s step
# (docs/benchmarks.md, "The guest's tests two at a time").
threads=${EGRET_GUEST_TEST_THREADS:-2}
if [[ ! $threads =~ ^[1-9][0-9]*$ ]]; then
  echo "guest-kernel: EGRET_GUEST_TEST_THREADS=\"$threads\" is not a positive count of test threads" >&2
  exit 2
fi

# target name -> (package directory, executable), from cargo's own record.
mapfile -t built < <(
  cargo test --workspace --locked --no-run --message-format=json 2>/dev/null | python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], os.path.dirname(m["manifest_path"]), m["executable"], sep="\t")
'
)

script=$(mktemp /var/tmp/egret-guest-tests.XXXXXX)
trap 'rm -f "$script"' EXIT
{
  # run_one NAME DIR EXE MIN ARGS...: runs one test binary and fails it when
  # it ran fewer than MIN tests. A name filter (`--exact`, `--skip`) that
  # matches nothing passes with "0 passed": a renamed test would leave the
  # guest testing nothing.
  cat <<'GUEST'
set -o pipefail
failed=()
run_one() {
  local name=$1 dir=$2 exe=$3 min=$4 threads=$5 log ran started
  shift 5
  echo "==> [6.1] $name --test-threads=$threads $*"
  log=$(mktemp)
  started=$SECONDS
  if ! (cd "$dir" && RUST_BACKTRACE=1 "$exe" --test-threads="$threads" "$@") 2>&1 | tee "$log"; then
    failed+=("$name")
  else
    ran=$(awk '/^test result:/ { n += $4 } END { print n + 0 }' "$log")
    if ((ran < min)); then
      echo "==> [6.1] $name ran $ran tests, expected at least $min: was a test renamed?"
      failed+=("$name")
    fi
  fi
  echo "==> [6.1] $name took $((SECONDS - started)) s"
  rm -f "$log"
}
GUEST
  for entry in "${plan[@]}"; do
    name=${entry%%|*} args=${entry#*|}
    line=$(printf '%s\n' "${built[@]}" | awk -F'\t' -v n="$name" '$1 == n' | head -n 1)
    if [[ -z $line ]]; then
      echo "guest-kernel: no test binary named $name (cargo test --no-run)" >&2
      exit 1
    fi
    IFS=$'\t' read -r _ dir exe <<< "$line"
    # --exact names each test: all of them must run; else at least one.
    min=1
    [[ $name == e2e ]] && min=${#e2e[@]}
    printf 'run_one %q %q %q %d %d %s\n' "$name" "$dir" "$exe" "$min" "$threads" "$args"
  done
  # shellcheck disable=SC2016 # expanded in the guest
  echo 'if ((${#failed[@]})); then echo "==> [6.1] failed: ${failed[*]}"; exit 1; fi; echo "==> [6.1] all passed"'
} > "$script"

tests/guest-kernel/run.sh --cpus 2 --memory 4096 --timeout "${EGRET_GUEST_TIMEOUT:-2400}" -- bash "$script"
