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
# Results (in bench/results/<UTC date-time>/; on a lent machine, where $OUT is set, in
# $BUILD_DIR/suite-results/, packed after every step into $OUT/gpu_suite.tar.gz with a copy of
# metadata.json and summary.txt beside it, so a run cut off by its time limit still returns what
# it did):
#   metadata.json     device (nvidia-smi), driver, date, commit, compiler, every command line with
#                     its exit status and duration, and which benchmarks were missing
#   environment.log   what the machine has: GPU, driver, nvcc, compilers, cmake, python3, torch,
#                     torchvision, transformers, Python headers
#   configure.log, build.log, ctest.log (verbose), ctest.xml (JUnit)
#   <bench>.json      a benchmark's stdout (--json); <bench>.log its stderr
#   torch_gpu_checks.json  the PyTorch plugin on the GPU (when python3 there has torch)
#   traces/           real-model allocator traces recorded with PyTorch (record_torch_traces.py),
#                     replayed by spillway-replay into replay_torch_traces.json
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
#   SPILLWAY_GPU_STEPS   the steps to run, in this order, space-separated, of: build tests bench
#                        torch_alloc spill_bandwidth traces train max_batch ("torch" names the last
#                        five; default: all). Configure always runs (cheap once the cache exists).
#   SPILLWAY_GPU_DEADLINE  seconds from the start after which no step starts and the running one
#                        is stopped (recorded with exit 124); default none. A lent machine runs 10
#                        minutes per call: order the steps by what matters most.
#   SPILLWAY_CTEST_ARGS  extra ctest arguments, e.g. "-L gpu" for the tests that use a GPU when
#                        there is one (the others run on every CI machine)
#   SPILLWAY_TORCH_ALLOC_ARGS  extra arguments for torch_alloc_bench.py (e.g. "--batches 50")
#   SPILLWAY_TRACE_ARGS  extra arguments for record_torch_traces.py (e.g. "--models resnet50,gpt2")
#   SPILLWAY_TRAIN_ARGS  extra arguments for train_bench.py's suite run (e.g. "--models resnet50
#                        --budgets 1.0,0.5"), with --resume, to cut the 132-process suite up
#   SPILLWAY_MAX_BATCH_ARGS  extra arguments for train_bench.py --max-batch
#   SPILLWAY_GPU_CXX     the C++ compiler (default: $CXX, unless that one has no shared libstdc++
#                        and /usr/bin/g++ has: the H200 machine's /opt/gcc links it statically,
#                        and a LibTorch test program then holds two C++ runtimes; Note [One C++
#                        runtime per symbol] in docs/integration.md). Read at the first configure.
#   SPILLWAY_COMMIT      the commit to record; without it, the tree's .git HEAD (a lent machine's
#                        copy of the tree may carry a .git that is not the tree's: name it)
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
started=$(date +%s)
deadline=${SPILLWAY_GPU_DEADLINE:-}
if [[ -n $deadline && ! $deadline =~ ^[0-9]+$ ]]; then
  echo "gpu_suite: SPILLWAY_GPU_DEADLINE='$deadline': expected a whole number of seconds" >&2
  exit 2
fi
if [[ -n ${OUT:-} ]]; then
  # Kept between calls on a warm machine, so train_bench --resume goes on where the last call was
  # cut off; the last call's metadata and summary are kept under other names.
  out=$build/suite-results
  for f in metadata.json summary.txt; do
    [[ -f $out/$f ]] && mv "$out/$f" "$out/earlier-$(date -r "$out/$f" +%H%M%S)-$f"
  done
else
  out=$repo/bench/results/$(date -u +%Y%m%d-%H%M%S)
fi
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
all_steps="build tests bench torch_alloc spill_bandwidth traces train max_batch"
torch_steps="torch_alloc spill_bandwidth traces train max_batch"
read -r -a wanted_steps <<< "${SPILLWAY_GPU_STEPS:-$all_steps}"
for w in "${wanted_steps[@]}"; do
  if [[ $w != torch && " $all_steps " != *" $w "* ]]; then
    echo "gpu_suite: SPILLWAY_GPU_STEPS names '$w'; expected some of: $all_steps torch" >&2
    exit 2
  fi
done
want() {  # want <step>: the step was asked for ("torch" asks for every PyTorch step)
  local w
  for w in "${wanted_steps[@]}"; do
    [[ $w == "$1" ]] && return 0
    [[ $w == torch && " $torch_steps " == *" $1 "* ]] && return 0
  done
  return 1
}

# run_step <name> <log> <command...>: runs a command with its output in <log>, records it, and
# packs the results so far. step_display, when set, is the command line recorded instead of "$*".
# Past the deadline the step is recorded as not run (exit 125); a step cut off by it exits 124.
run_step() {
  local name=$1 log=$2
  shift 2
  local start end rc shown=${step_display:-$*} limit=()
  if [[ -n $deadline ]]; then
    local left=$((started + deadline - $(date +%s)))
    if [[ $left -lt 5 ]]; then
      echo "gpu_suite: $name: not run, the deadline (${deadline} s) has passed"
      steps+=("{\"step\": $(json_escape "$name"), \"command\": $(json_escape "$shown"), \"exit_code\": 125,\
 \"seconds\": 0, \"log\": null, \"not_run\": \"deadline\"}")
      failed=1
      return 125
    fi
    limit=(timeout --kill-after=10 "$left")
  fi
  start=$(date +%s.%N)
  echo "gpu_suite: $name: $shown"
  "${limit[@]}" "$@" > "$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  steps+=("{\"step\": $(json_escape "$name"), \"command\": $(json_escape "$shown"), \"exit_code\": $rc,\
 \"seconds\": $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }'),\
 \"log\": $(json_escape "$(basename "$log")")}")
  [[ $rc -eq 0 ]] || { echo "gpu_suite: $name failed (exit $rc); see $log" >&2; failed=1; }
  write_metadata
  pack_results
  return $rc
}

# --- metadata and packing (after every step) --------------------------------------------------------
ran=()      # benchmarks run
missing=()  # benchmarks asked for that could not run
cuda_skips=0
join() { local IFS=,; echo "$*"; }
write_metadata() {
  local gpu commit dirty i sep
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null | head -n 1)
  commit=${SPILLWAY_COMMIT:-$(git -C "$repo" rev-parse HEAD 2> /dev/null || echo unknown)}
  dirty=$(git -C "$repo" status --porcelain --untracked-files=no 2> /dev/null | grep -q . && echo true || echo false)
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
    echo "  \"steps_asked\": $(json_escape "${wanted_steps[*]}"),"
    echo "  \"deadline_s\": ${deadline:-null},"
    echo "  \"elapsed_s\": $(($(date +%s) - started)),"
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
}
# On a lent machine only $OUT comes back, and only a few files: one archive of everything, and the
# two small files worth reading first.
pack_results() {
  [[ -n ${OUT:-} ]] || return 0
  tar -czf "$OUT/gpu_suite.tar.gz.part" -C "$out" . && mv "$OUT/gpu_suite.tar.gz.part" "$OUT/gpu_suite.tar.gz"
  cp "$out/metadata.json" "$OUT/"
  [[ -f $out/summary.txt ]] && cp "$out/summary.txt" "$OUT/"
  return 0
}
# summary <line>: one line of the human summary (summary.txt, also printed).
summary() { echo "$*" | tee -a "$out/summary.txt"; }
# json_summary <file>: a line per case of torch_gpu_checks.json, or per configuration of
# train_bench.json, into the summary: a lent machine's reply carries only the end of the output.
json_summary() {
  [[ -f $1 ]] && command -v python3 > /dev/null || return 0
  python3 - "$1" << 'PY' | while read -r line; do summary "$line"; done
import json, sys
d = json.load(open(sys.argv[1]))
if isinstance(d.get("results"), list):
    for r in d["results"]:
        step, error = r.get("step_ms_median"), (r.get("error") or "").splitlines()
        print(f"train_bench: {r.get('model')} {r.get('config')} ratio {r.get('ratio')}: {r.get('status')}"
              + (f", {step} ms" if step else "") + (f" ({error[0][:100]})" if error else ""))
else:
    for case, r in d.items():
        if isinstance(r, dict) and "passed" in r:
            print(f"torch_gpu_checks: {case}: {'passed' if r['passed'] else 'FAILED'}")
PY
  # A crash's native stack (SPILLWAY_CRASH_BACKTRACE) with spillway's frames decoded by addr2line
  # (its module hides its symbols): the whole into crash_stacks-<name>.txt, the start of each
  # stack into the summary.
  local stacks="$out/crash_stacks-$(basename "$1" .json).txt"
  python3 "$repo/bench/decode_backtrace.py" "$1" > "$stacks" 2>&1 || true
  if grep -q '^== ' "$stacks"; then
    grep -A 24 '^== ' "$stacks" | while IFS= read -r line; do summary "crash: $line"; done
  else
    rm -f "$stacks"
  fi
}

# --- the machine ------------------------------------------------------------------------------------
environment() {
  nvidia-smi
  nvcc --version
  c++ --version | head -n 1
  # How the compiler CMake takes links its C++ runtime (spillway_cxx_runtime.cmake tells too).
  local cxx=${CXX:-c++}
  echo "CXX='${CXX:-}' CC='${CC:-}' LDFLAGS='${LDFLAGS:-}' CXXFLAGS='${CXXFLAGS:-}'"
  echo "$cxx -> $(readlink -f "$(command -v "$cxx")"): $("$cxx" --version | head -n 1)"
  echo "  libstdc++.so: $("$cxx" -print-file-name=libstdc++.so); libstdc++.a: $("$cxx" -print-file-name=libstdc++.a)"
  echo "  specs naming static-libstdc++: $("$cxx" -dumpspecs 2> /dev/null | grep -c static-libstdc++)"
  cmake --version | head -n 1
  command -v ninja && ninja --version
  echo "python3: $(command -v python3)"
  python3 - << 'PY'
import importlib, sys, sysconfig, os
print("python", sys.version.split()[0])
inc = sysconfig.get_paths()["include"]
print("Python.h:", os.path.exists(os.path.join(inc, "Python.h")), inc)
for name in ("torch", "torchvision", "transformers"):
    try:
        m = importlib.import_module(name)
        print(name, m.__version__, getattr(getattr(m, "version", None), "cuda", "") if name == "torch" else "")
    except Exception as e:  # report, never fail: the steps that need it say so
        print(name, "missing:", e)
PY
}
export -f environment  # run_step may run it under timeout, which needs a program
run_step environment "$out/environment.log" bash -c environment
sed -n '1,/^$/p' "$out/environment.log" | grep -E 'Driver|NVIDIA H' | head -n 2

# --- configure and build ----------------------------------------------------------------------------
# A compiler whose libstdc++ is shared, like the one python and libtorch load (see SPILLWAY_GPU_CXX).
shared_runtime() { [[ $("$1" -print-file-name=libstdc++.so 2> /dev/null) == /* ]]; }
if [[ -n ${SPILLWAY_GPU_CXX:-} ]]; then
  export CXX=$SPILLWAY_GPU_CXX CUDAHOSTCXX=$SPILLWAY_GPU_CXX
elif ! shared_runtime "${CXX:-c++}" && [[ -x /usr/bin/g++ ]] && shared_runtime /usr/bin/g++; then
  summary "configure: ${CXX:-c++} has no shared libstdc++; building with /usr/bin/g++"
  export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++  # nvcc's host compiler too (it links CUDA-only programs)
  [[ -x /usr/bin/gcc ]] && export CC=/usr/bin/gcc
fi
generator=()
keep_going=(-- -k)
if command -v ninja > /dev/null; then generator=(-G Ninja); keep_going=(-- -k 0); fi
if [[ -f $build/CMakeCache.txt ]]; then generator=(); fi  # the cache already names one

# The PyTorch plugin is built against the python3 on PATH (on the GPU machines, the one with torch).
python_hint=()
if command -v python3 > /dev/null; then python_hint=(-DPython3_EXECUTABLE="$(command -v python3)"); fi
run_step configure "$out/configure.log" \
  cmake -S "$repo" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type" "${python_hint[@]}" \
        -DSPILLWAY_WITH_CUDA=ON -DSPILLWAY_BUILD_TESTS=ON -DSPILLWAY_BUILD_BENCH=ON \
        -DBoost_NO_BOOST_CMAKE=ON -DBoost_NO_SYSTEM_PATHS=ON -DBoost_INCLUDE_DIR="$carry" \
        -DDOCTEST_INCLUDE_DIR="$carry"
configured=$?
grep -E '^-- spillway:' "$out/configure.log"
grep -E '^-- spillway: C\+\+ runtime' "$out/configure.log" | while read -r line; do summary "configure: ${line#-- }"; done
if [[ $configured -eq 0 ]] && want build; then
  # Keep going past a target that does not build, so the rest still runs.
  run_step build "$out/build.log" cmake --build "$build" -j "$jobs" "${keep_going[@]}"
  grep -E 'error|FAILED' "$out/build.log" | head -n 20
fi

# --- tests ------------------------------------------------------------------------------------------
if [[ $configured -eq 0 ]] && want tests; then
  # shellcheck disable=SC2086  # SPILLWAY_CTEST_ARGS is a word list on purpose
  run_step ctest "$out/ctest.log" \
    ctest --test-dir "$build" -V --timeout 900 --output-junit "$out/ctest.xml" ${SPILLWAY_CTEST_ARGS:-}
  grep -E '^[0-9]+% tests passed|tests failed|\*\*\*Failed|Not Run|\(Failed\)|\(Timeout\)' "$out/ctest.log" |
    tail -n 20 | while read -r line; do summary "ctest: $line"; done
  # Issue 4's PyTorch checks on the GPU (tests/torch_gpu_checks.py, run by ctest when torch is found).
  cp "$build/tests/torch_gpu_checks.json" "$out/" 2> /dev/null || true
  json_summary "$out/torch_gpu_checks.json"
  # A GPU machine whose CUDA tests all skipped tested nothing (e.g. a driver older than the
  # CUDA runtime): that is a failure here, not a pass.
  cuda_skips=$(grep -c 'SKIPPED: no CUDA device' "$out/ctest.log")
  if [[ $cuda_skips -gt 0 ]]; then
    summary "gpu_suite: $cuda_skips CUDA test cases skipped for lack of a device:" \
            "$(grep -m1 'SKIPPED: no CUDA device' "$out/ctest.log")"
    failed=1
  fi
  write_metadata
  pack_results
fi

# --- benchmarks -------------------------------------------------------------------------------------
# The tools that measure the GPU (--device cuda). The others (policy bench, eviction simulator,
# trace generators) run on the CPU and the simulated device, and belong to the CPU suite.
benches=(spillway-alloc-bench spillway-stress spillway-replay)
if [[ -n ${SPILLWAY_BENCHES:-} ]]; then
  read -r -a benches <<< "$SPILLWAY_BENCHES"
fi
want bench || benches=()
for name in "${benches[@]}"; do
  bin=$build/bench/$name
  if [[ ! -x $bin ]]; then
    summary "gpu_suite: benchmark $name was not built; skipped"
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
torch_ready=false
if [[ -d $build/python/spillway ]] && python3 -c "import torch" > /dev/null 2>&1; then torch_ready=true; fi
py_env=(env "PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1)
# torch_step <step> <name> <log> <command...>: a PyTorch step, when asked for and possible.
torch_step() {
  local step=$1 name=$2
  want "$step" || return 0
  if ! $torch_ready; then
    summary "gpu_suite: $name skipped: no python3 with torch, or no $build/python/spillway"
    missing+=("$(json_escape "$name")")
    return 0
  fi
  shift 2
  run_step "$name" "$@"
  ran+=("$(json_escape "$name")")
}
# shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
{
  torch_step torch_alloc torch_alloc_bench "$out/torch_alloc_bench.log" \
    "${py_env[@]}" python3 "$repo/bench/torch_alloc_bench.py" ${SPILLWAY_TORCH_ALLOC_ARGS:-} \
      --json "$out/torch_alloc_bench.json"
  torch_step spill_bandwidth train_bench:spill_bandwidth "$out/spill_bandwidth.log" \
    "${py_env[@]}" python3 "$repo/bench/train_bench.py" --spill-bandwidth --no-progress \
      --json "$out/spill_bandwidth.json"
  # Real-model allocator traces, recorded with PyTorch's allocator, replayed by spillway's on the
  # GPU: peak reserved over peak allocated, each against PyTorch's own on the same trace.
  torch_step traces record_torch_traces "$out/record_torch_traces.log" \
    "${py_env[@]}" python3 "$repo/bench/record_torch_traces.py" --out "$out/traces" ${SPILLWAY_TRACE_ARGS:-}
  if want traces && compgen -G "$out/traces/*.trace.gz" > /dev/null && [[ -x $build/bench/spillway-replay ]]; then
    traces=$(ls "$out"/traces/*.trace.gz | paste -sd,)
    step_display="spillway-replay --trace $traces --device cuda --json > $out/replay_torch_traces.json" \
    run_step replay_torch_traces "$out/replay_torch_traces.log" \
      bash -c 'exec "$1" --trace "$2" --device cuda --json > "$3"' _ \
      "$build/bench/spillway-replay" "$traces" "$out/replay_torch_traces.json"
  fi
  torch_step train train_bench "$out/train_bench.log" \
    "${py_env[@]}" python3 "$repo/bench/train_bench.py" --timeline --resume --no-progress \
      ${SPILLWAY_TRAIN_ARGS:-} --json "$out/train_bench.json"
  want train && json_summary "$out/train_bench.json"
  torch_step max_batch train_bench:max_batch "$out/max_batch.log" \
    "${py_env[@]}" python3 "$repo/bench/train_bench.py" --max-batch --models resnet50,gpt2-medium \
      --resume --no-progress ${SPILLWAY_MAX_BATCH_ARGS:-} --json "$out/max_batch.json"
  if [[ -f $out/train_bench.json ]]; then
    run_step plot_results "$out/plot_results.log" \
      python3 "$repo/bench/plot_results.py" --train "$out/train_bench.json" --out "$out/plots"
  fi
}

write_metadata
summary "gpu_suite: results in $out ($([[ $failed -eq 0 ]] && echo passed || echo FAILED)," \
        "$(($(date +%s) - started)) s)"
pack_results
exit $failed
