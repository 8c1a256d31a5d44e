#!/usr/bin/env bash
# gpu_suite.sh: the one script that builds spillway with CUDA and runs the whole GPU suite on a
# GPU machine: configure, build, ctest (every test, serially: some fill the GPU), then every
# benchmark with --device cuda --json.
#
#   bench/gpu_suite.sh                      # from anywhere; results in $OUT or bench/results/<date>/
#
# The GPU machine is offline and has no Boost or doctest: their headers come from
# third_party_carry/include, prepared on a development machine by bench/prepare_gpu_carry.sh.
#
# Results (in $OUT when set, else bench/results/<UTC date-time>/):
#   metadata.json     device (nvidia-smi), driver, date, commit, compiler, every command line with
#                     its exit status and duration, and which benchmarks were missing
#   configure.log, build.log, ctest.log (verbose), ctest.xml (JUnit)
#   <bench>.json      a benchmark's stdout (--json); <bench>.log its stderr
#   torch_gpu_checks.json  the PyTorch plugin on the GPU (when python3 there has torch)
#
# Env
#   BUILD_DIR            build directory (default <repo>/build-gpu; kept between runs)
#   BUILD_TYPE           CMake build type (default Release: benchmark numbers)
#   JOBS                 build parallelism (default nproc)
#   SPILLWAY_BENCHES     space-separated benchmark names to run, in order; a name that was not
#                        built is recorded as missing and skipped. Default: the GPU tools,
#                        spillway-alloc-bench, spillway-stress and spillway-replay.
#   SPILLWAY_BENCH_ARGS  extra arguments for every benchmark (e.g. "--smoke")
#   BENCH_TIMEOUT        seconds per benchmark (default 600)
#   SPILLWAY_GPU_STEPS   the steps to run, space-separated, of: build tests bench torch (default:
#                        all). Configure always runs (cheap once the cache exists). A lent machine
#                        runs 10 minutes per call: one step per call, with BUILD_DIR and OUT kept.
#   SPILLWAY_TRAIN_ARGS  extra arguments for train_bench.py's suite run (e.g. "--models resnet50
#                        --budgets 1.0,0.5"), with --resume, to cut the 132-process suite up
#   SPILLWAY_COMMIT      the commit to record when the tree has no .git
#
# Exit status: 0 when everything built and passed; 1 otherwise. Every step runs regardless, so a
# failing test still leaves benchmark numbers (marked as such in metadata.json).
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
carry=$repo/third_party_carry/include
build=${BUILD_DIR:-$repo/build-gpu}
build_type=${BUILD_TYPE:-Release}
jobs=${JOBS:-$(nproc)}
bench_timeout=${BENCH_TIMEOUT:-600}
bench_args=${SPILLWAY_BENCH_ARGS:-}
out=${OUT:-$repo/bench/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$out"

if [[ ! -f $carry/boost/version.hpp || ! -f $carry/doctest/doctest.h ]]; then
  echo "gpu_suite: $carry lacks boost/ or doctest/; run bench/prepare_gpu_carry.sh on a machine" \
       "that has them and carry third_party_carry/ here" >&2
  exit 1
fi

# Nested configures (the package consumer test's find_package(spillway) -> find_dependency(Boost))
# find the carried headers through FindBoost's environment hint.
export BOOST_INCLUDEDIR=$carry

# --- a tiny JSON writer (no python needed) ---------------------------------------------------------
json_escape() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/ }
  s=${s//$'\r'/}
  printf '"%s"' "$s"
}
steps=()  # one JSON object per command run
failed=0
read -r -a wanted_steps <<< "${SPILLWAY_GPU_STEPS:-build tests bench torch}"
want() {  # want <step>: the step was asked for
  local w
  for w in "${wanted_steps[@]}"; do [[ $w == "$1" ]] && return 0; done
  return 1
}

# run_step <name> <log> <command...>: runs a command with its output in <log>, records it.
# step_display, when set, is the command line recorded instead of "$*".
run_step() {
  local name=$1 log=$2
  shift 2
  local start end rc shown=${step_display:-$*}
  start=$(date +%s.%N)
  echo "gpu_suite: $name: $shown"
  "$@" > "$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  steps+=("{\"step\": $(json_escape "$name"), \"command\": $(json_escape "$shown"), \"exit_code\": $rc,\
 \"seconds\": $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }'),\
 \"log\": $(json_escape "$(basename "$log")")}")
  [[ $rc -eq 0 ]] || { echo "gpu_suite: $name failed (exit $rc); see $log" >&2; failed=1; }
  return $rc
}

# --- configure and build ----------------------------------------------------------------------------
generator=()
keep_going=(-- -k)
if command -v ninja > /dev/null; then generator=(-G Ninja); keep_going=(-- -k 0); fi
if [[ -f $build/CMakeCache.txt ]]; then generator=(); fi  # the cache already names one

run_step configure "$out/configure.log" \
  cmake -S "$repo" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type" \
        -DSPILLWAY_WITH_CUDA=ON -DSPILLWAY_BUILD_TESTS=ON -DSPILLWAY_BUILD_BENCH=ON \
        -DBoost_NO_BOOST_CMAKE=ON -DBoost_NO_SYSTEM_PATHS=ON -DBoost_INCLUDE_DIR="$carry" \
        -DDOCTEST_INCLUDE_DIR="$carry"
configured=$?
if [[ $configured -eq 0 ]] && want build; then
  # Keep going past a target that does not build, so the rest still runs.
  run_step build "$out/build.log" cmake --build "$build" -j "$jobs" "${keep_going[@]}"
  tail -n 30 "$out/build.log"
fi

# --- tests ------------------------------------------------------------------------------------------
cuda_skips=0
if [[ $configured -eq 0 ]] && want tests; then
  run_step ctest "$out/ctest.log" \
    ctest --test-dir "$build" -V --timeout 900 --output-junit "$out/ctest.xml"
  grep -E '^[0-9]+% tests passed|tests failed|\*\*\*Failed|Not Run' "$out/ctest.log" | tail -n 20
  # Issue 4's PyTorch checks on the GPU (tests/torch_gpu_checks.py, run by ctest when torch is found).
  cp "$build/tests/torch_gpu_checks.json" "$out/" 2>/dev/null || true
  # A GPU machine whose CUDA tests all skipped tested nothing (e.g. a driver older than the
  # CUDA runtime): that is a failure here, not a pass.
  cuda_skips=$(grep -c 'SKIPPED: no CUDA device' "$out/ctest.log")
  if [[ $cuda_skips -gt 0 ]]; then
    echo "gpu_suite: $cuda_skips CUDA test cases skipped for lack of a device:" >&2
    grep -m1 'SKIPPED: no CUDA device' "$out/ctest.log" >&2
    failed=1
  fi
fi

# --- benchmarks -------------------------------------------------------------------------------------
# The tools that measure the GPU (--device cuda). The others (policy bench, eviction simulator,
# trace generators) run on the CPU and the simulated device, and belong to the CPU suite.
benches=(spillway-alloc-bench spillway-stress spillway-replay)
if [[ -n ${SPILLWAY_BENCHES:-} ]]; then
  read -r -a benches <<< "$SPILLWAY_BENCHES"
fi
missing=()
ran=()
want bench || benches=()
for name in "${benches[@]}"; do
  bin=$build/bench/$name
  if [[ ! -x $bin ]]; then
    echo "gpu_suite: benchmark $name was not built; skipped"
    missing+=("$(json_escape "$name")")
    continue
  fi
  # shellcheck disable=SC2086  # bench_args is a word list on purpose
  step_display="$bin --device cuda --json $bench_args > $out/$name.json" \
  run_step "bench:$name" "$out/$name.log" \
    bash -c 'exec timeout "$1" "$2" --device cuda --json "${@:4}" > "$3"' _ \
    "$bench_timeout" "$bin" "$out/$name.json" $bench_args
  ran+=("$(json_escape "$name")")
done

# --- PyTorch benchmarks (docs/results.md): python3 with torch, and the package in $build/python ------
if ! want torch; then
  :
elif [[ -d $build/python/spillway ]] && python3 -c "import torch" > /dev/null 2>&1; then
  py_env=(env "PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}")
  run_step torch_alloc_bench "$out/torch_alloc_bench.log" \
    "${py_env[@]}" python3 "$repo/bench/torch_alloc_bench.py" --json "$out/torch_alloc_bench.json"
  run_step train_bench:spill_bandwidth "$out/spill_bandwidth.log" \
    "${py_env[@]}" python3 "$repo/bench/train_bench.py" --spill-bandwidth --json "$out/spill_bandwidth.json"
  run_step train_bench "$out/train_bench.log" \
    "${py_env[@]}" python3 "$repo/bench/train_bench.py" --timeline --resume ${SPILLWAY_TRAIN_ARGS:-} \
      --json "$out/train_bench.json"
  run_step train_bench:max_batch "$out/max_batch.log" \
    "${py_env[@]}" python3 "$repo/bench/train_bench.py" --max-batch --models resnet50,gpt2-medium \
      --resume --json "$out/max_batch.json"
  run_step plot_results "$out/plot_results.log" \
    python3 "$repo/bench/plot_results.py" --train "$out/train_bench.json" --out "$out/plots"
  ran+=("$(json_escape torch_alloc_bench)" "$(json_escape train_bench)")
else
  echo "gpu_suite: no python3 with torch, or no $build/python/spillway: the PyTorch benchmarks were skipped"
  missing+=("$(json_escape torch_alloc_bench)" "$(json_escape train_bench)")
fi

# --- metadata ---------------------------------------------------------------------------------------
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null | head -n 1)
commit=$(git -C "$repo" rev-parse HEAD 2> /dev/null || echo "${SPILLWAY_COMMIT:-unknown}")
dirty=$(git -C "$repo" status --porcelain --untracked-files=no 2> /dev/null | grep -q . && echo true || echo false)
join() { local IFS=,; echo "$*"; }
{
  echo "{"
  echo "  \"suite\": \"spillway gpu_suite\","
  echo "  \"date\": $(json_escape "$(date -u +%Y-%m-%dT%H:%M:%SZ)"),"
  echo "  \"host\": $(json_escape "$(hostname)"),"
  echo "  \"device\": $(json_escape "${gpu:-no GPU visible to nvidia-smi}"),"
  echo "  \"nvidia_smi\": $(json_escape "$(nvidia-smi -L 2> /dev/null)"),"
  echo "  \"nvcc\": $(json_escape "$(nvcc --version 2> /dev/null | tail -n 1)"),"
  echo "  \"cxx\": $(json_escape "$(grep -m1 '^CMAKE_CXX_COMPILER:' "$build/CMakeCache.txt" 2> /dev/null | cut -d= -f2-)"),"
  echo "  \"commit\": $(json_escape "$commit"),"
  echo "  \"tracked_changes\": $dirty,"
  echo "  \"build_dir\": $(json_escape "$build"),"
  echo "  \"build_type\": $(json_escape "$build_type"),"
  echo "  \"cuda_test_cases_skipped\": $cuda_skips,"
  echo "  \"benchmarks_run\": [$(join "${ran[@]}")],"
  echo "  \"benchmarks_missing\": [$(join "${missing[@]}")],"
  echo "  \"steps\": ["
  for i in "${!steps[@]}"; do
    sep=,
    [[ $i -eq $((${#steps[@]} - 1)) ]] && sep=
    echo "    ${steps[$i]}$sep"
  done
  echo "  ],"
  echo "  \"passed\": $([[ $failed -eq 0 ]] && echo true || echo false)"
  echo "}"
} > "$out/metadata.json"

echo "gpu_suite: results in $out ($([[ $failed -eq 0 ]] && echo passed || echo FAILED))"
exit $failed
