#!/usr/bin/env bash
# Builds spillway (via scripts/setup.sh) and runs every test and benchmark smoke test with CTest.
#
#   scripts/test.sh                 the tests, in build/
#   scripts/test.sh --sanitizers    also: all tests under AddressSanitizer + UBSan (build-asan/),
#                                   and under ThreadSanitizer (build-tsan/); the PyTorch plugin is
#                                   left out of those two (torch's libraries are not instrumented)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

run_ctest() {  # <build dir> [ctest args...]
  local dir=$1; shift
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" "$@"
}

scripts/setup.sh
run_ctest build

if [ "${1:-}" = "--sanitizers" ]; then
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  BUILD_DIR=build-asan BUILD_TYPE=RelWithDebInfo scripts/setup.sh -DSPILLWAY_SANITIZE=address,undefined -DSPILLWAY_WITH_TORCH=OFF
  run_ctest build-asan
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  BUILD_DIR=build-tsan BUILD_TYPE=RelWithDebInfo scripts/setup.sh -DSPILLWAY_SANITIZE=thread -DSPILLWAY_WITH_TORCH=OFF
  run_ctest build-tsan
fi
