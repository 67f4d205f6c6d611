#!/usr/bin/env bash
# Where the gateway core's time goes in one mode of the end-to-end benchmark
# (issue 32; docs/benchmarks.md, "Where the fast path's time goes").
#
#   tests/fast-path-profile.sh [MODE] [FLOWS]      (default: fastpath 50000)
#
# Runs `egret-throughput --modes MODE --flows FLOWS` with a long window and,
# in its middle, samples both cores by time with perf (cpu-clock: the VMs of
# this machine kind have no PMU, so cycles and cache misses cannot be
# counted, but a load that waits for memory shows as the samples on the
# instruction after it). Prints the gateway core's share by function and
# offset, then the offsets inside the XDP program with their source lines
# (tests/bpf_jit_lines.py, read while the program is still loaded).
# A profiling aid, not a test: tests/run.sh does not run it. Needs root and
# a release build (cargo build --release -p egret-benches -p egret-controlplane).
set -euo pipefail
# (No `head` in the pipelines: with pipefail, a writer it stops early fails
# the script.)
cd "$(dirname "$0")/.."

mode=${1:-fastpath}
flows=${2:-50000}
gw_cpu=1
seconds=24
record_after=12
record_for=5

for tool in perf python3; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "tests/fast-path-profile.sh: $tool is missing (perf: Debian package linux-perf; python3: python3): run tests/install-deps.sh" >&2
    exit 1
  fi
done
bench=target/release/egret-throughput
if [[ ! -x $bench ]]; then
  echo "tests/fast-path-profile.sh: $bench is missing: cargo build --release -p egret-benches -p egret-controlplane" >&2
  exit 1
fi

out=$(mktemp -d)
bench_pid=
# The benchmark deletes its namespaces and programs when it ends: on an
# early exit, stop it (SIGINT: it cleans up) and wait for it.
cleanup() {
  if [[ -n $bench_pid ]]; then
    kill -INT "$bench_pid" 2>/dev/null || true
    wait "$bench_pid" 2>/dev/null || true
  fi
  rm -rf "$out"
}
trap cleanup EXIT

"$bench" --modes "$mode" --flows "$flows" --rounds 1 --seconds "$seconds" --warmup 2 --gw-cpu "$gw_cpu" >"$out/bench.txt" 2>&1 &
bench_pid=$!
sleep "$record_after"
if ! perf record -q -a -e cpu-clock -F 5000 -o "$out/perf.data" -- sleep "$record_for"; then
  echo "tests/fast-path-profile.sh: perf record failed (root? kernel.perf_event_paranoid?)" >&2
  exit 1
fi
perf script -i "$out/perf.data" -F cpu,ip,sym,symoff 2>/dev/null |
  awk -v cpu="[00$gw_cpu]" '$1 == cpu { print $3; print $2, $3 >"'"$out/ips.txt"'" }' >"$out/gw.txt"
total=$(wc -l <"$out/gw.txt")

echo "gateway core (CPU $gw_cpu): $total samples in ${record_for} s; share by function"
sed 's/+0x[0-9a-f]*$//' "$out/gw.txt" | sort | uniq -c | sort -rn |
  awk -v t="$total" 'NR <= 12 { printf "  %5.1f%%  %s\n", 100 * $1 / t, $2 }'
echo "by offset (over 1 % of the core; a BPF program's offsets as perf gives them, see below)"
sort "$out/gw.txt" | uniq -c | sort -rn |
  awk -v t="$total" '100 * $1 / t >= 1 { printf "  %5.1f%%  %s\n", 100 * $1 / t, $2 }'

prog=$({ grep -o '^bpf_prog_[0-9a-f]*_[A-Za-z0-9_]*' "$out/gw.txt" || true; } | sort | uniq -c | sort -rn | awk 'NR == 1 { print $2 }')
if [[ -n $prog ]]; then
  echo "inside $prog, by source line (share of the program's samples)"
  # The samples' addresses, read against the loaded program itself: perf
  # can name a BPF program by a stale symbol (an earlier run's tag and
  # start), which shifts its offsets.
  awk -v p="$prog" 'index($2, p "+0x") == 1 { print $1 }' "$out/ips.txt" |
    python3 tests/bpf_jit_lines.py "${prog#bpf_prog_*_}" 8 | sed 's/^/  /'
else
  echo "no samples in an XDP program on the gateway core"
fi

wait "$bench_pid" || true
bench_pid=
echo "the benchmark's own report:"
grep -E "^(mode|$mode) " "$out/bench.txt" || cat "$out/bench.txt"
