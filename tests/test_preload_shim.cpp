// test_preload_shim: libspillway_preload.so seen from an ordinary CUDA program. This program links
// only the CUDA runtime -- tests/fake_cudart, which runs on host memory -- and knows nothing of
// spillway; ctest runs it with LD_PRELOAD=libspillway_preload.so and SPILLWAY_CONF, once per test
// suite:
//   cuda      backend:cuda,budget:64MiB                  spillway's CUDA backend over the fake runtime
//   sim       backend:sim,budget:64MiB,sim_capacity:128MiB  the simulated device
//   bad_conf  budget:lots                                 an invalid SPILLWAY_CONF
//
// It proves: the program's cudaMalloc/cudaFree/cudaMallocAsync/cudaFreeAsync/cudaMemGetInfo are the
// shim's; cudaMemGetInfo reports the budget as the total and what is left as free; allocations
// stop at the budget with cudaErrorMemoryAllocation and spillway's message; spillway's own
// cudaMalloc of a segment reaches the real runtime instead of the shim (Note [Preload re-entrancy]:
// otherwise this would recurse until the stack overflows); memory the runtime handed out directly
// (before the shim, cudaMallocManaged, cudaMallocAsync) is freed by the real functions; a double
// free of spillway memory -- even of a segment's base address -- is reported and never reaches the
// real cudaFree, and unknown pointers are the real runtime's error, never a crash; cudaMalloc's and
// stream-ordered allocations on the legacy stream never share memory (Note [Preload streams]);
// threads allocate concurrently; an invalid SPILLWAY_CONF fails allocations, not the program.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fake_cudart.h"
#include "spillway_alloc.h"

namespace {

constexpr std::size_t M = std::size_t{1} << 20;

// The shim's C ABI and the fake runtime's own entry points (the "real" functions, bypassing the
// shim: what a library loaded before the shim, or the runtime itself, would call).
struct process {
  decltype(&spillway_get_stats) get_stats = nullptr;
  decltype(&spillway_last_error) last_error = nullptr;
  decltype(&spillway_empty_cache) empty_cache = nullptr;
  decltype(&cudaMalloc) real_malloc = nullptr;
  decltype(&cudaMallocAsync) real_malloc_async = nullptr;

  process() {
    get_stats = reinterpret_cast<decltype(get_stats)>(dlsym(RTLD_DEFAULT, "spillway_get_stats"));
    last_error = reinterpret_cast<decltype(last_error)>(dlsym(RTLD_DEFAULT, "spillway_last_error"));
    empty_cache = reinterpret_cast<decltype(empty_cache)>(dlsym(RTLD_DEFAULT, "spillway_empty_cache"));
    const bool preloaded = get_stats != nullptr && last_error != nullptr && empty_cache != nullptr;
    REQUIRE_MESSAGE(preloaded, "run this under LD_PRELOAD=libspillway_preload.so");
    void* runtime = dlopen("libcudart.so." SPILLWAY_CUDART_MAJOR, RTLD_NOW | RTLD_NOLOAD);
    REQUIRE_MESSAGE(runtime != nullptr, dlerror());
    real_malloc = reinterpret_cast<decltype(real_malloc)>(dlsym(runtime, "cudaMalloc"));
    real_malloc_async = reinterpret_cast<decltype(real_malloc_async)>(dlsym(runtime, "cudaMallocAsync"));
    const bool resolved = real_malloc != nullptr && real_malloc_async != nullptr;
    REQUIRE(resolved);
    const bool interposed = real_malloc != &cudaMalloc;  // the program's cudaMalloc is the shim's
    REQUIRE(interposed);
  }

  spillway_stats stats() const {
    spillway_stats s{};
    REQUIRE(get_stats(0, &s, sizeof s) == 0);
    return s;
  }
  std::string error() const { return last_error(); }
};

process& proc() {
  static process p;
  return p;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

bool is_cuda_backend() { return std::string(std::getenv("SPILLWAY_CONF")).find("backend:cuda") != std::string::npos; }

void require_clean() {
  proc().empty_cache();
  REQUIRE(proc().stats().reserved_bytes == 0);
}

}  // namespace

// --- with a working shim (backend cuda or sim) ---------------------------------------------------

void program_functions_are_the_shims() {
  Dl_info info{};
  REQUIRE(dladdr(reinterpret_cast<void*>(&cudaMalloc), &info) != 0);
  CHECK(contains(info.dli_fname, "libspillway_preload"));
  REQUIRE(dladdr(reinterpret_cast<void*>(&cudaStreamCreate), &info) != 0);
  CHECK(contains(info.dli_fname, "libcudart"));  // everything else is the runtime's
}

void mem_get_info_reports_the_budget() {
  require_clean();
  std::size_t free_bytes = 0, total_bytes = 0;
  REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess);
  CHECK(total_bytes == 64 * M);
  CHECK(free_bytes == 64 * M);
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 24 * M) == cudaSuccess);
  REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess);
  CHECK(total_bytes == 64 * M);
  CHECK(free_bytes == 40 * M);
  CHECK(cudaFree(p) == cudaSuccess);
  REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess);
  CHECK(free_bytes == 64 * M);  // freed memory is free to the program, cached or not
  CHECK(cudaMemGetInfo(nullptr, &total_bytes) == cudaErrorInvalidValue);
}

void allocations_stop_at_the_budget() {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  std::vector<void*> blocks;
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < 100 && err == cudaSuccess; ++i) {
    void* p = nullptr;
    err = cudaMalloc(&p, 12 * M);
    if (err == cudaSuccess) {
      REQUIRE(p != nullptr);
      CHECK(cudaMemset(p, i, 12 * M) == cudaSuccess);  // usable memory
      blocks.push_back(p);
    }
  }
  CHECK(err == cudaErrorMemoryAllocation);
  CHECK(blocks.size() == 5);  // 5 x 12 MiB fit in 64 MiB, a sixth does not
  CHECK(contains(proc().error(), "spillway: out of memory on device 0"));
  CHECK(contains(proc().error(), "budget 64.00 MiB"));
  const fake_cudart_counters during = fake_cudart_get_counters();
  if (is_cuda_backend()) {
    // spillway reserved its segments from the real runtime: the shim sent its own calls there.
    CHECK(during.mallocs == before.mallocs + 5);
    CHECK(during.bytes_in_use == before.bytes_in_use + 60 * M);
  } else {
    CHECK(during.mallocs == before.mallocs);  // the simulated device's memory
  }
  unsigned char first = 0;
  CHECK(cudaMemcpy(&first, blocks[3], 1, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(first == 3);
  for (void* p : blocks) CHECK(cudaFree(p) == cudaSuccess);
  CHECK(fake_cudart_get_counters().frees == before.frees);  // cached by spillway, not freed
  proc().empty_cache();
  const fake_cudart_counters after = fake_cudart_get_counters();
  CHECK(after.bytes_in_use == before.bytes_in_use);
  if (is_cuda_backend()) CHECK(after.frees == before.frees + 5);
}

void foreign_memory_goes_to_the_real_functions() {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  const std::uint64_t invalid_before = proc().stats().num_invalid_frees;
  void* direct = nullptr;  // as if allocated before the shim was loaded
  REQUIRE(proc().real_malloc(&direct, 3 * M) == cudaSuccess);
  void* managed = nullptr;
  REQUIRE(cudaMallocManaged(&managed, 1 * M, cudaMemAttachGlobal) == cudaSuccess);
  void* direct_async = nullptr;
  REQUIRE(proc().real_malloc_async(&direct_async, 2 * M, nullptr) == cudaSuccess);
  CHECK(cudaFree(direct) == cudaSuccess);
  CHECK(cudaFree(managed) == cudaSuccess);
  CHECK(cudaFreeAsync(direct_async, nullptr) == cudaSuccess);
  const fake_cudart_counters after = fake_cudart_get_counters();
  CHECK(after.frees == before.frees + 2);
  CHECK(after.async_frees == before.async_frees + 1);
  CHECK(after.invalid_frees == before.invalid_frees);
  CHECK(after.bytes_in_use == before.bytes_in_use);
  CHECK(proc().stats().num_invalid_frees == invalid_before);  // none of it was spillway's business
  CHECK(cudaFree(nullptr) == cudaSuccess);  // the context-initialisation idiom
}

void double_frees_are_reported_and_stay_in_spillway() {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  const std::uint64_t invalid_before = proc().stats().num_invalid_frees;
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 12 * M) == cudaSuccess);  // the base of its segment
  CHECK(cudaFree(p) == cudaSuccess);
  CHECK(cudaFree(p) == cudaErrorInvalidValue);
  CHECK(contains(proc().error(), "not a live allocation"));
  CHECK(proc().stats().num_invalid_frees == invalid_before + 1);
  CHECK(proc().stats().reserved_bytes == 12 * M);  // the segment is still spillway's, cached
  void* q = nullptr;
  REQUIRE(cudaMallocAsync(&q, 4 * M, nullptr) == cudaSuccess);
  CHECK(cudaFreeAsync(q, nullptr) == cudaSuccess);
  CHECK(cudaFreeAsync(q, nullptr) == cudaErrorInvalidValue);
  const fake_cudart_counters after = fake_cudart_get_counters();
  CHECK(after.invalid_frees == before.invalid_frees);  // nothing reached the real runtime
  CHECK(after.frees == before.frees);
  CHECK(after.async_frees == before.async_frees);

  int on_stack = 0;  // unknown to everybody: the real runtime's error, not a crash
  CHECK(cudaFree(&on_stack) == cudaErrorInvalidValue);
  CHECK(fake_cudart_get_counters().invalid_frees == before.invalid_frees + 1);
}

void stream_ordered_allocations() {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  cudaStream_t s1 = nullptr, s2 = nullptr;
  REQUIRE(cudaStreamCreate(&s1) == cudaSuccess);
  REQUIRE(cudaStreamCreate(&s2) == cudaSuccess);
  void* a = nullptr;
  REQUIRE(cudaMallocAsync(&a, 1 * M, s1) == cudaSuccess);
  CHECK(cudaFreeAsync(a, s1) == cudaSuccess);
  void* b = nullptr;
  REQUIRE(cudaMallocAsync(&b, 1 * M, s1) == cudaSuccess);
  CHECK(b == a);  // stream order: reused at once on its own stream
  CHECK(cudaFreeAsync(b, s2) == cudaSuccess);  // freed on another stream: ordered after s2's work
  CHECK(proc().stats().allocations == 0);
  CHECK(fake_cudart_get_counters().async_mallocs == before.async_mallocs);  // spillway served them

  // cudaMalloc's memory and the legacy stream's stream-ordered memory never share blocks.
  void* sync = nullptr;
  REQUIRE(cudaMalloc(&sync, 1 * M) == cudaSuccess);
  CHECK(cudaFree(sync) == cudaSuccess);
  void* legacy = nullptr;
  REQUIRE(cudaMallocAsync(&legacy, 1 * M, nullptr) == cudaSuccess);
  if (is_cuda_backend()) CHECK(legacy != sync);  // (the simulated device has one stream)
  CHECK(cudaFreeAsync(legacy, cudaStreamLegacy) == cudaSuccess);
  CHECK(cudaStreamDestroy(s1) == cudaSuccess);
  CHECK(cudaStreamDestroy(s2) == cudaSuccess);
}

// A stream being captured into a graph: its allocations are the runtime's (the graph records its
// own allocation node), and spillway's memory cannot be freed into the graph.
void graph_capture() {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  void* mine = nullptr;
  REQUIRE(cudaMallocAsync(&mine, 1 * M, s) == cudaSuccess);  // before the capture: spillway's
  fake_cudart_set_capturing(s, 1);
  void* captured = nullptr;
  REQUIRE(cudaMallocAsync(&captured, 1 * M, s) == cudaSuccess);
  CHECK(captured != mine);
  CHECK(fake_cudart_get_counters().async_mallocs == before.async_mallocs + 1);  // the runtime's
  CHECK(cudaFreeAsync(captured, s) == cudaSuccess);
  CHECK(fake_cudart_get_counters().async_frees == before.async_frees + 1);
  CHECK(cudaFreeAsync(mine, s) == cudaErrorStreamCaptureUnsupported);
  CHECK(contains(proc().error(), "being captured into a graph"));
  void* other = nullptr;  // another stream, not captured: spillway's again, and mine stays live
  REQUIRE(cudaMallocAsync(&other, 1 * M, nullptr) == cudaSuccess);
  CHECK(other != mine);
  fake_cudart_set_capturing(s, 0);
  CHECK(cudaFreeAsync(mine, s) == cudaSuccess);  // after the capture
  CHECK(cudaFreeAsync(other, nullptr) == cudaSuccess);
  CHECK(fake_cudart_get_counters().async_mallocs == before.async_mallocs + 1);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
}

// A child forked after spillway made its CUDA allocator cannot use it (CUDA does not survive a
// fork): its calls go to the real runtime (Note [Preload and fork]).
void forked_child_goes_to_the_runtime() {
  require_clean();
  void* mine = nullptr;
  REQUIRE(cudaMalloc(&mine, 1 * M) == cudaSuccess);  // spillway's allocator exists
  CHECK(cudaFree(mine) == cudaSuccess);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const fake_cudart_counters before = fake_cudart_get_counters();
    void* p = nullptr;
    const bool ok = cudaMalloc(&p, 1 * M) == cudaSuccess &&
                    fake_cudart_get_counters().mallocs == before.mallocs + 1 &&  // the runtime's
                    cudaFree(p) == cudaSuccess &&
                    fake_cudart_get_counters().frees == before.frees + 1;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  void* again = nullptr;  // the parent keeps spillway
  const fake_cudart_counters before = fake_cudart_get_counters();
  REQUIRE(cudaMalloc(&again, 1 * M) == cudaSuccess);
  CHECK(fake_cudart_get_counters().mallocs == before.mallocs);
  CHECK(cudaFree(again) == cudaSuccess);
}

// cudaStreamPerThread is one handle for each thread's own stream, so its frees are not ordered
// for another thread: the shim waits for the freeing thread's stream first (Note [Preload
// streams]). Other streams' frees stay asynchronous.
void per_thread_stream_frees_wait_for_the_stream() {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  void* a = nullptr;
  REQUIRE(cudaMallocAsync(&a, 1 * M, cudaStreamPerThread) == cudaSuccess);
  CHECK(cudaFreeAsync(a, cudaStreamPerThread) == cudaSuccess);
  // The _ptsz variants (what a program built with per-thread default streams calls) are the
  // shim's; this runtime has none, so they are looked up as such a program would bind them.
  using malloc_fn = cudaError_t (*)(void**, size_t, cudaStream_t);
  using free_fn = cudaError_t (*)(void*, cudaStream_t);
  const auto malloc_ptsz = reinterpret_cast<malloc_fn>(dlsym(RTLD_DEFAULT, "cudaMallocAsync_ptsz"));
  const auto free_ptsz = reinterpret_cast<free_fn>(dlsym(RTLD_DEFAULT, "cudaFreeAsync_ptsz"));
  REQUIRE(static_cast<bool>(malloc_ptsz));
  REQUIRE(static_cast<bool>(free_ptsz));
  REQUIRE(malloc_ptsz(&a, 1 * M, nullptr) == cudaSuccess);  // NULL: the per-thread stream here
  CHECK(free_ptsz(a, nullptr) == cudaSuccess);
  const std::uint64_t expected = is_cuda_backend() ? 2 : 0;  // the simulated device: one stream
  CHECK(fake_cudart_get_counters().per_thread_syncs == before.per_thread_syncs + expected);
  REQUIRE(cudaMallocAsync(&a, 1 * M, nullptr) == cudaSuccess);
  CHECK(cudaFreeAsync(a, nullptr) == cudaSuccess);  // the legacy stream: no wait
  CHECK(fake_cudart_get_counters().per_thread_syncs == before.per_thread_syncs + expected);
  CHECK(proc().stats().allocations == 0);
}

void argument_checks() {
  CHECK(cudaMalloc(nullptr, 1024) == cudaErrorInvalidValue);
  void* p = reinterpret_cast<void*>(0x1);
  CHECK(cudaMalloc(&p, 0) == cudaSuccess);
  CHECK(p == nullptr);
  CHECK(cudaMalloc(&p, std::size_t{1} << 60) == cudaErrorMemoryAllocation);  // as the runtime says
  if (is_cuda_backend()) {
    // A fault the device reports reaches the program as that fault, not cudaErrorUnknown.
    REQUIRE(cudaMalloc(&p, 1024) == cudaSuccess);
    fake_cudart_fail_next_device_sync(cudaErrorIllegalAddress);
    CHECK(cudaFree(p) == cudaErrorIllegalAddress);  // cudaFree synchronises the device first
    CHECK(contains(proc().error(), "cudaErrorIllegalAddress"));
  }
}

void threads_allocate_concurrently() {
  require_clean();
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &failures] {
      cudaStream_t s = nullptr;
      if (cudaStreamCreate(&s) != cudaSuccess) ++failures[t];
      for (int i = 0; i < 200; ++i) {
        void* p = nullptr;
        void* q = nullptr;
        if (cudaMalloc(&p, 4096 * (1 + i % 5)) != cudaSuccess) ++failures[t];
        if (cudaMallocAsync(&q, 8192, s) != cudaSuccess) ++failures[t];
        if (cudaFree(p) != cudaSuccess) ++failures[t];
        if (cudaFreeAsync(q, s) != cudaSuccess) ++failures[t];
      }
      cudaStreamDestroy(s);
    });
  }
  for (auto& th : threads) th.join();
  for (int f : failures) CHECK(f == 0);
  CHECK(proc().stats().allocations == 0);
}

#define SHIM_CASES(suite)                                                                           \
  TEST_CASE("the program's allocation functions are the shim's" * doctest::test_suite(suite)) {     \
    program_functions_are_the_shims();                                                              \
  }                                                                                                 \
  TEST_CASE("cudaMemGetInfo reports the budget" * doctest::test_suite(suite)) { mem_get_info_reports_the_budget(); } \
  TEST_CASE("allocations stop at the budget" * doctest::test_suite(suite)) { allocations_stop_at_the_budget(); } \
  TEST_CASE("foreign memory goes to the real functions" * doctest::test_suite(suite)) {           \
    foreign_memory_goes_to_the_real_functions();                                                    \
  }                                                                                                 \
  TEST_CASE("double frees are reported and stay in spillway" * doctest::test_suite(suite)) {      \
    double_frees_are_reported_and_stay_in_spillway();                                               \
  }                                                                                                 \
  TEST_CASE("stream-ordered allocations" * doctest::test_suite(suite)) { stream_ordered_allocations(); } \
  TEST_CASE("argument checks" * doctest::test_suite(suite)) { argument_checks(); }                 \
  TEST_CASE("graph capture" * doctest::test_suite(suite)) { graph_capture(); }                    \
  TEST_CASE("fork" * doctest::test_suite(suite)) {                                                \
    if (is_cuda_backend()) forked_child_goes_to_the_runtime();                                    \
  }                                                                                              \
  TEST_CASE("per-thread stream frees wait for the stream" * doctest::test_suite(suite)) {          \
    per_thread_stream_frees_wait_for_the_stream();                                                 \
  }                                                                                                \
  TEST_CASE("threads" * doctest::test_suite(suite)) { threads_allocate_concurrently(); }

SHIM_CASES("cuda")
SHIM_CASES("sim")

// --- an invalid SPILLWAY_CONF: allocations fail, the program does not -----------------------------

TEST_CASE("bad_conf: allocations fail with the parser's message; frees and queries still work" *
          doctest::test_suite("bad_conf")) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, 1 * M) == cudaErrorInitializationError);
  CHECK(contains(proc().error(), "bad value \"lots\" for key \"budget\""));
  CHECK(cudaMallocAsync(&p, 1 * M, nullptr) == cudaErrorInitializationError);
  std::size_t free_bytes = 0, total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess);  // the device's own answer
  CHECK(total_bytes == FAKE_CUDART_CAPACITY);
  void* direct = nullptr;
  REQUIRE(proc().real_malloc(&direct, 1 * M) == cudaSuccess);
  CHECK(cudaFree(direct) == cudaSuccess);  // foreign memory is still freed
  CHECK(cudaFree(nullptr) == cudaSuccess);
}
