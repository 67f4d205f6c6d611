#!/usr/bin/env bash
# Runs every Egret test: the README's second command, and what CI runs.
#
#   sudo tests/run.sh            # everything
#   sudo tests/run.sh --quick    # skip rustfmt, clippy and the fuzz smoke run
#   sudo EGRET_RELEASE_IMAGES=1 tests/run.sh   # the images with a release egret
#
# Without cargo-fuzz the fuzz smoke run is skipped with a message;
# EGRET_REQUIRE_FUZZ=1 (set by .ci/run) makes that a failure.
#
# Needs root (network namespaces, XDP, AF_XDP, BPF_PROG_TEST_RUN). Installs
# what it needs (tests/install-deps.sh, idempotent), builds the Kubernetes API
# server used by the control-plane tests once (cached under /var/cache/egret),
# builds the container and node images (tests/image.sh, cached there too),
# then builds and tests the whole workspace (which starts both images), here
# and on Linux 6.1 (the oldest kernel Egret supports) in an emulated machine
# (tests/guest-kernel).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=sched.sh
source tests/sched.sh

quick=0
[[ "${1:-}" == "--quick" ]] && quick=1

started=$(date +%s)
last_step=$started
# Each step line says how long the run has taken and how long the step before
# it took, so a slow CI run shows where its time went.
step() {
  local now
  now=$(date +%s)
  printf '\n==> [%s s, previous step %s s] %s\n' "$((now - started))" "$((now - last_step))" "$*"
  last_step=$now
}

if [[ $(id -u) -ne 0 ]]; then
  echo "tests/run.sh must run as root (network namespaces, XDP, AF_XDP)" >&2
  exit 1
fi

step "installing dependencies"
tests/install-deps.sh

# kube-apiserver and kube-proxy for the Kubernetes tests (cached; a cold build
# is about 15 minutes of Go on 2 cores): built in the background, beside the
# workspace and the images, whose builds leave a core idle for minutes at a
# time (one large crate, a link, debootstrap's downloads). Waited for before
# the tests; its output is printed then.
step "kube-apiserver and kube-proxy for the Kubernetes tests (cached), in the background"
apiserver_log=$(mktemp /tmp/egret-build-apiserver.XXXXXX)
# Its own process group (setsid), so that a failed step below stops the Go
# build under it too.
setsid -w tests/k8s/build-apiserver.sh >"$apiserver_log" 2>&1 &
apiserver_pid=$!
trap 'kill -- "-$apiserver_pid" 2>/dev/null || true' EXIT

step "building the workspace"
cargo build --workspace --all-targets --locked

# The images users deploy (tests/image.sh; cached under
# ${EGRET_CACHE:-/var/cache/egret}/images), built here so that their cold build
# stays out of the tests that start them (container_image, node_image).
# EGRET_IMAGE_BIN: those tests start images with this same binary.
#
# Here the images carry the egret every other test runs, the debug build just
# made: a release build of the control plane took 1,190 s on 2 quiet cores,
# most of it one crate (aws-sdk-ec2) on one core, and would push CI past its
# budget (docs/benchmarks.md, "Build time"). The recipe, the files, the units
# and the boot are the same; only the optimisation of the one binary differs.
# EGRET_RELEASE_IMAGES=1 builds and tests them with the release egret, as
# `tests/image.sh` builds them for users.
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
if [[ ${EGRET_RELEASE_IMAGES:-0} == 1 ]]; then
  step "the images users deploy, with a release egret (tests/image.sh)"
  cargo build --release --locked -p egret-controlplane --bin egret
  EGRET_IMAGE_BIN=$(readlink -f "$target_dir/release/egret")
else
  step "the images users deploy, with the tests' egret (tests/image.sh; EGRET_RELEASE_IMAGES=1 for a release egret)"
  EGRET_IMAGE_BIN=$(readlink -f "$target_dir/debug/egret")
fi
export EGRET_IMAGE_BIN
EGRET_BIN=$EGRET_IMAGE_BIN tests/image.sh

step "waiting for the kube-apiserver build"
if ! wait "$apiserver_pid"; then
  cat "$apiserver_log"
  echo "tests/k8s/build-apiserver.sh failed (its output is above)" >&2
  exit 1
fi
cat "$apiserver_log"
rm -f "$apiserver_log"
apiserver_pid=

# clippy and the fuzz targets' build run in the background beside the lab
# tests (egret-tests): both are CPU work with nothing to wait for, and the
# labs leave a core idle for minutes while they wait out Leases, restarts and
# timeouts. (The labs must hold on a busy machine anyway: users' gateways are
# busy.) They start when the first egret-tests binary does, after the
# CPU-bound unit and BPF tests, and have their own target directories, so
# neither waits for the tests' lock. Their results are read after the guest
# kernel's step. (`cargo test -p` for each half would build the shared
# dependencies again: features are unified over the packages selected.)
checks_log=$(mktemp -d /tmp/egret-checks.XXXXXX)
clippy_pid= fuzz_build_pid=
start_checks() {
  # nice 19: they take what the tests leave idle, never the tests' time (the
  # node image's boot under emulation has a timeout). Each runs in a session of
  # its own, so the session gets the priority too (tests/sched.sh: under
  # autogroup scheduling nice alone ranked each of them as an equal of the tests).
  CARGO_TARGET_DIR=$target_dir/clippy setsid -w nice -n 19 cargo clippy --workspace --all-targets --locked -- -D warnings \
    >"$checks_log/clippy" 2>&1 &
  clippy_pid=$!
  session_priority "$clippy_pid" 19
  if cargo fuzz --version >/dev/null 2>&1; then
    # Both targets; `cargo fuzz run` below then finds them built.
    setsid -w nice -n 19 bash -c 'cd dataplane/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build' >"$checks_log/fuzz-build" 2>&1 &
    fuzz_build_pid=$!
    session_priority "$fuzz_build_pid" 19
  fi
  printf '\n==> [%s s] clippy and the fuzz build started in the background\n' "$(($(date +%s) - started))"
}
trap 'for p in $apiserver_pid $clippy_pid $fuzz_build_pid; do kill -- "-$p" 2>/dev/null || true; done; rm -rf "$checks_log"' EXIT
((quick == 1)) || cargo fmt --all --check

step "unit, property, BPF, end-to-end and Kubernetes tests"
# One test binary at a time: the network-namespace tests are heavy on a
# 2-core machine; each test still runs its own threads. cargo runs in the
# background, its output both shown and kept, so that this shell can start
# the checks when the first egret-tests binary runs, and then waits for
# cargo itself (not for its output's end, which a process a test leaked
# could hold open).
tests_log=$checks_log/tests
RUST_BACKTRACE=1 cargo test --workspace --locked -- --test-threads="${EGRET_TEST_THREADS:-2}" > >(tee "$tests_log") 2>&1 &
tests_pid=$!
if ((quick == 0)); then
  while kill -0 "$tests_pid" 2>/dev/null; do
    if grep -q 'Running unittests src/lib.rs (.*egret_tests-' "$tests_log" 2>/dev/null; then
      break
    fi
    sleep 2
  done
  start_checks
fi
wait "$tests_pid"

step "the XDP program and AF_XDP on Debian bookworm's Linux 6.1 (an emulated machine, tests/guest-kernel)"
tests/guest-kernel/egret-tests.sh

step "fixture frames through the release build (optimised code paths)"
# A name filter that matches nothing passes with "0 passed": a renamed module
# would leave this step testing nothing. 37 tests match today.
fixtures_log=$(mktemp /tmp/egret-fixtures.XXXXXX)
cargo test --release --locked -p egret-dataplane --lib fixtures 2>&1 | tee "$fixtures_log"
fixtures_ran=$(awk '/^test result:/ { n += $4 } END { print n + 0 }' "$fixtures_log")
rm -f "$fixtures_log"
if ((fixtures_ran < 30)); then
  echo "the release fixture step ran $fixtures_ran tests (the filter 'fixtures' matched fewer than 30): was the module renamed?" >&2
  exit 1
fi

step "the cloud API emulators' own tests (tests/emulators: the contract the providers' tests rely on)"
for emulator in tests/emulators/*/test_emulator.py; do
  python3 -B "$emulator"
done

step "instructions per established packet and per new flow, against benches/instructions.txt (tests/instructions.sh)"
# Counted by callgrind on the release build: deterministic, so asserted here
# (a rise of more than 10 % fails); no timing is. Also in --quick: it is a
# test, and costs about a minute beside the build above.
tests/instructions.sh

if ((quick == 0)); then
  step "clippy (run beside the tests)"
  if ! wait "$clippy_pid"; then
    cat "$checks_log/clippy"
    echo "cargo clippy failed (its output is above)" >&2
    exit 1
  fi
  clippy_pid=
  grep -v '^ *\(Compiling\|Checking\)' "$checks_log/clippy" || true

  if [[ -n $fuzz_build_pid ]]; then
    step "the fuzz targets' build (run beside the tests)"
    if ! wait "$fuzz_build_pid"; then
      cat "$checks_log/fuzz-build"
      echo "cargo fuzz build failed (its output is above)" >&2
      exit 1
    fi
    fuzz_build_pid=
    tail -n 3 "$checks_log/fuzz-build"
  fi

  if cargo fuzz --version >/dev/null 2>&1; then
    # Two targets, 20 s each (README, "Fuzzing"): the engine alone, and the
    # XDP program against the engine (root: BPF_PROG_TEST_RUN, a namespace).
    # Both start from the fixture frames.
    step "fuzz smoke run (engine and differential, 20 s each; run longer with: cd dataplane/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run TARGET corpus/TARGET)"
    for target in engine differential; do
      cargo run --quiet --locked -p egret-dataplane --features fixtures --example fixture_frames -- "dataplane/fuzz/corpus/$target"
    done
    (cd dataplane/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run engine corpus/engine -- -max_total_time=20 -rss_limit_mb=4096)
    # regressions/differential: inputs on which the two once disagreed,
    # replayed first on every run.
    (cd dataplane/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run differential corpus/differential regressions/differential -- -max_total_time=20 -rss_limit_mb=4096)
  elif [[ "${EGRET_REQUIRE_FUZZ:-0}" == 1 ]]; then
    echo "the fuzz smoke run cannot run: cargo-fuzz is not installed, and EGRET_REQUIRE_FUZZ=1 (set by .ci/run) makes that a failure" >&2
    exit 1
  else
    step "fuzz smoke run skipped: cargo-fuzz is not installed (cargo install cargo-fuzz)"
  fi
fi

step "all tests passed in $(( $(date +%s) - started )) s"
