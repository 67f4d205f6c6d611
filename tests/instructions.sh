#!/usr/bin/env bash
# The instruction-count guard (issue 32): instructions the engine executes per
# established packet and per new flow, counted by valgrind's callgrind on a
# release build, against the figures recorded in benches/instructions.txt.
# Counts do not depend on the machine's load: this is a test, not a timing.
#
#   tests/instructions.sh            compare; fails on a rise of more than 10 %
#   tests/instructions.sh --record   measure and rewrite benches/instructions.txt
#   tests/instructions.sh --runs N   each case N times (the median; prints the spread)
#
# A drop of more than 10 % is reported, not a failure: re-record to keep the
# guard tight. The cases and the comparison: dataplane/examples/instructions.rs.
# Run by tests/run.sh after the release fixture step (which builds most of
# what the example needs).
set -euo pipefail
cd "$(dirname "$0")/.."

figures=benches/instructions.txt
mode=check runs=1
while (($# > 0)); do
  case $1 in
    --record) mode=record ;;
    --runs)
      if (($# < 2)); then
        echo "usage: tests/instructions.sh [--record] [--runs N]" >&2
        exit 2
      fi
      runs=$2
      shift
      ;;
    *)
      echo "usage: tests/instructions.sh [--record] [--runs N]" >&2
      exit 2
      ;;
  esac
  shift
done

if ! command -v valgrind >/dev/null 2>&1; then
  echo "tests/instructions.sh: valgrind is missing (Debian package valgrind): run tests/install-deps.sh" >&2
  exit 1
fi

example=(cargo run --quiet --release --locked -p egret-dataplane --features fixtures --example instructions --)
if [[ $mode == record ]]; then
  # The commit the figures were measured on (-dirty: with changes not yet committed).
  commit=$(git describe --always --dirty 2>/dev/null || echo unknown)
  "${example[@]}" record "$figures" "$commit" "$(date -u +%F)" --runs "$runs"
else
  "${example[@]}" check "$figures" --runs "$runs"
fi
