// test_pluggable_abi: libspillway_alloc.so through its C ABI (torch_plugin/spillway_alloc.h), the
// way PyTorch's CUDAPluggableAllocator and C programs use it: dlopen, dlsym, call.
//
// ctest runs it three times, one test suite each, with SPILLWAY_CONF set in the environment:
//   sim        backend:sim,budget:64MiB      the simulated device (no GPU)
//   cuda_fake  backend:cuda,budget:64MiB     spillway's CUDA backend over tests/fake_cudart
//   bad_conf   bugdet:1GiB                   an invalid SPILLWAY_CONF
//
// It proves: malloc returns usable, distinct memory and free returns it; size 0 is NULL; out of
// memory within the budget throws (spillway_malloc, as PyTorch needs) or returns NULL
// (spillway_try_malloc), with spillway's message in both the exception and spillway_last_error;
// NULL, foreign and double frees and record_stream of foreign pointers are reported, never a crash;
// record_stream orders a free after the other stream; set_budget, set_memory_fraction, base_alloc,
// get_stats, mem_get_info and empty_cache do what spillway_alloc.h says; errors are per thread;
// with the CUDA backend the segments come from the CUDA runtime and go back to it; an invalid
// SPILLWAY_CONF fails every allocation with the parser's message.
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "spillway_alloc.h"

#if SPILLWAY_TEST_FAKE_CUDART
#include <cuda_runtime_api.h>

#include "fake_cudart.h"
#endif

namespace {

constexpr std::size_t M = std::size_t{1} << 20;

// The C ABI, resolved from the library as CUDAPluggableAllocator resolves it (by name).
struct abi {
  void* handle = nullptr;
  decltype(&spillway_malloc) malloc = nullptr;
  decltype(&spillway_free) free = nullptr;
  decltype(&spillway_init) init = nullptr;
  decltype(&spillway_empty_cache) empty_cache = nullptr;
  decltype(&spillway_set_memory_fraction) set_memory_fraction = nullptr;
  decltype(&spillway_base_alloc) base_alloc = nullptr;
  decltype(&spillway_record_stream) record_stream = nullptr;
  decltype(&spillway_try_malloc) try_malloc = nullptr;
  decltype(&spillway_set_budget) set_budget = nullptr;
  decltype(&spillway_get_stats) get_stats = nullptr;
  decltype(&spillway_mem_get_info) mem_get_info = nullptr;
  decltype(&spillway_stream_create) stream_create = nullptr;
  decltype(&spillway_stream_destroy) stream_destroy = nullptr;
  decltype(&spillway_last_error) last_error = nullptr;

  template <class F>
  void get(F& out, const char* name) {
    out = reinterpret_cast<F>(dlsym(handle, name));
    const bool found = out != nullptr;
    REQUIRE_MESSAGE(found, "missing symbol ", name);
  }

  abi() {
    handle = dlopen(SPILLWAY_ALLOC_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    REQUIRE_MESSAGE(handle != nullptr, dlerror());
    get(malloc, "spillway_malloc");
    get(free, "spillway_free");
    get(init, "spillway_init");
    get(empty_cache, "spillway_empty_cache");
    get(set_memory_fraction, "spillway_set_memory_fraction");
    get(base_alloc, "spillway_base_alloc");
    get(record_stream, "spillway_record_stream");
    get(try_malloc, "spillway_try_malloc");
    get(set_budget, "spillway_set_budget");
    get(get_stats, "spillway_get_stats");
    get(mem_get_info, "spillway_mem_get_info");
    get(stream_create, "spillway_stream_create");
    get(stream_destroy, "spillway_stream_destroy");
    get(last_error, "spillway_last_error");
  }

  spillway_stats stats(int device = 0) const {
    spillway_stats s{};
    REQUIRE(get_stats(device, &s, sizeof s) == 0);
    return s;
  }
  std::string error() const { return last_error(); }
};

abi& lib() {
  static abi a;  // one process-wide allocator, as in a real process
  return a;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The message of the exception spillway_malloc throws, "" if it returns.
std::string malloc_error(ssize_t size, int device = 0) {
  try {
    void* p = lib().malloc(size, device, nullptr);
    lib().free(p, size, device, nullptr);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Nothing live and nothing cached: each test case starts from a clean allocator.
void require_clean() {
  lib().empty_cache();
  const spillway_stats s = lib().stats();
  REQUIRE(s.allocated_bytes == 0);
  REQUIRE(s.reserved_bytes == 0);
}

}  // namespace

// --- every backend ----------------------------------------------------------------------------

void malloc_free_basics() {
  require_clean();
  auto* a = static_cast<unsigned char*>(lib().malloc(1 * M, 0, nullptr));
  auto* b = static_cast<unsigned char*>(lib().malloc(3000, 0, nullptr));
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(a != b);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 512 == 0);
  spillway_stats s = lib().stats();
  CHECK(s.allocations == 2);
  CHECK(s.allocated_bytes == 1 * M + 3072);  // rounded to 512 bytes
  CHECK(s.requested_bytes == 1 * M + 3000);
  CHECK(s.budget == 64 * M);
  lib().free(a, 1 * M, 0, nullptr);
  lib().free(b, 3000, 0, nullptr);
  s = lib().stats();
  CHECK(s.allocations == 0);
  CHECK(s.reserved_bytes > 0);  // cached
  lib().empty_cache();
  CHECK(lib().stats().reserved_bytes == 0);
}

void size_zero_and_null() {
  CHECK(lib().malloc(0, 0, nullptr) == nullptr);
  CHECK(lib().try_malloc(0, 0, nullptr) == nullptr);
  const std::string before = lib().error();
  lib().free(nullptr, 0, 0, nullptr);  // a no-op, not an error
  lib().record_stream(nullptr, nullptr);
  CHECK(lib().error() == before);
  CHECK(contains(malloc_error(-1), "spillway_malloc: negative size -1"));
}

void out_of_memory() {
  require_clean();
  const std::uint64_t ooms_before = lib().stats().num_ooms;
  void* big = lib().malloc(40 * M, 0, nullptr);
  REQUIRE(big != nullptr);
  const std::string thrown = malloc_error(40 * M);
  CHECK(contains(thrown, "spillway: out of memory on device 0"));
  CHECK(contains(thrown, "tried to allocate 40.00 MiB"));
  CHECK(contains(thrown, "budget 64.00 MiB"));
  CHECK(lib().error() == thrown);  // spillway_last_error has it too
  CHECK(lib().try_malloc(40 * M, 0, nullptr) == nullptr);
  CHECK(contains(lib().error(), "spillway: out of memory on device 0"));
  CHECK(lib().stats().num_ooms == ooms_before + 2);
  lib().free(big, 40 * M, 0, nullptr);
  void* again = lib().try_malloc(40 * M, 0, nullptr);  // nothing changed: it fits again
  CHECK(again != nullptr);
  lib().free(again, 40 * M, 0, nullptr);
}

void bad_device() {
  CHECK(contains(malloc_error(1024, 5), "invalid device 5: expected 0..0"));
  CHECK(lib().try_malloc(1024, -1, nullptr) == nullptr);
  CHECK(contains(lib().error(), "invalid device -1"));
  spillway_stats s{};
  CHECK(lib().get_stats(9, &s, sizeof s) == -1);
  CHECK(contains(lib().error(), "invalid device 9"));
}

void foreign_and_double_frees() {
  require_clean();
  const std::uint64_t invalid_before = lib().stats().num_invalid_frees;
  int on_stack = 0;
  lib().free(&on_stack, 4, 0, nullptr);
  CHECK(contains(lib().error(), "spillway_free(0x"));
  CHECK(contains(lib().error(), "): not allocated by spillway; ignored"));
  CHECK(lib().stats().num_invalid_frees == invalid_before);  // not spillway's memory: not its count

  void* p = lib().malloc(4096, 0, nullptr);
  lib().free(p, 4096, 0, nullptr);
  lib().free(p, 4096, 0, nullptr);  // double free
  CHECK(contains(lib().error(), "not a live allocation"));
  CHECK(lib().stats().num_invalid_frees == invalid_before + 1);

  void* q = lib().malloc(8192, 0, nullptr);
  lib().free(static_cast<char*>(q) + 512, 0, 0, nullptr);  // inside a block: reported, q lives on
  CHECK(contains(lib().error(), "not a live allocation"));
  CHECK(lib().stats().allocations == 1);
  lib().free(q, 8192, 0, nullptr);

  lib().record_stream(&on_stack, nullptr);
  CHECK(contains(lib().error(), "spillway_record_stream(0x"));
  CHECK(contains(lib().error(), "not a live allocation of spillway; ignored"));
}

void record_stream_orders_the_free() {
  require_clean();
  CUstream_st* other = lib().stream_create(0);
  REQUIRE_MESSAGE(other != nullptr, lib().error());
  void* p = lib().malloc(1 * M, 0, nullptr);
  lib().record_stream(p, other);
  const std::string before = lib().error();
  lib().free(p, 1 * M, 0, nullptr);
  CHECK(lib().error() == before);  // a deferred free is not an error
  CHECK(lib().stats().allocations == 0);
  lib().empty_cache();  // waits for the other stream, then releases
  CHECK(lib().stats().reserved_bytes == 0);
  CHECK(lib().stream_destroy(0, other) == 0);
}

void budgets_and_fractions() {
  require_clean();
  CHECK(lib().set_budget(0, 32 * M) == 0);
  CHECK(lib().stats().budget == 32 * M);
  CHECK(lib().try_malloc(40 * M, 0, nullptr) == nullptr);
  void* p = lib().malloc(16 * M, 0, nullptr);
  CHECK(lib().set_budget(0, 1 * M) == -1);  // below what is live: refused
  CHECK(contains(lib().error(), "budget"));
  CHECK(lib().stats().budget == 32 * M);   // the old one stays
  lib().free(p, 16 * M, 0, nullptr);

  const std::uint64_t total = lib().stats().device_total;
  lib().set_memory_fraction(0.125, 0);
  CHECK(lib().stats().budget == total / 8);
  lib().set_memory_fraction(1.5, 0);  // PyTorch's hook cannot fail: reported, nothing changes
  CHECK(contains(lib().error(), "spillway_set_memory_fraction(1.500000, device 0): expected a fraction in [0, 1]"));
  CHECK(lib().stats().budget == total / 8);
  // Below what is live, as torch's fraction: set, and allocations fail until frees (unlike
  // set_budget above).
  p = lib().malloc(16 * M, 0, nullptr);
  lib().set_memory_fraction(0.0, 0);
  CHECK(lib().stats().budget == 1);
  CHECK(lib().try_malloc(16 * M, 0, nullptr) == nullptr);
  lib().free(p, 16 * M, 0, nullptr);
  lib().set_memory_fraction(0.125, 0);
  CHECK(lib().stats().budget == total / 8);
  lib().set_memory_fraction(0.5, 3);
  CHECK(contains(lib().error(), "invalid device 3"));
  REQUIRE(lib().set_budget(0, 64 * M) == 0);
}

void base_alloc_and_stats() {
  require_clean();
  void* p = lib().malloc(3 * M, 0, nullptr);
  void* q = lib().malloc(1536 * 1024, 0, nullptr);  // the same 20 MiB segment, after p
  std::size_t size = 0;
  void* base = lib().base_alloc(q, &size);
  CHECK(size == 20 * M);
  CHECK(base == p);
  CHECK(reinterpret_cast<char*>(q) >= reinterpret_cast<char*>(base));
  CHECK(reinterpret_cast<char*>(q) < reinterpret_cast<char*>(base) + size);
  int on_stack = 0;
  size = 7;
  CHECK(lib().base_alloc(&on_stack, &size) == &on_stack);  // PyTorch's answer without the hook
  CHECK(size == 7);
  CHECK(contains(lib().error(), "spillway_base_alloc(0x"));

  // A caller that knows an older, shorter spillway_stats gets only its fields.
  std::uint64_t first_two[3] = {1, 1, 0xdead};
  CHECK(lib().get_stats(0, reinterpret_cast<spillway_stats*>(first_two), 2 * sizeof(std::uint64_t)) == 0);
  CHECK(first_two[0] == 64 * M);
  CHECK(first_two[2] == 0xdead);
  CHECK(lib().get_stats(0, nullptr, sizeof(spillway_stats)) == -1);
  CHECK(lib().get_stats(0, reinterpret_cast<spillway_stats*>(first_two), 4) == -1);
  CHECK(contains(lib().error(), "pass sizeof(spillway_stats)"));

  const spillway_stats s = lib().stats();
  CHECK(s.segments == 1);
  CHECK(s.reserved_bytes == 20 * M);
  CHECK(s.peak_allocated_bytes >= 4 * M + M / 2);
  std::size_t free_bytes = 0, total_bytes = 0;
  REQUIRE(lib().mem_get_info(0, &free_bytes, &total_bytes) == 0);
  CHECK(total_bytes == 64 * M);
  CHECK(free_bytes == 64 * M - (4 * M + M / 2));  // the cache is free to the program
  lib().free(p, 3 * M, 0, nullptr);
  lib().free(q, 1536 * 1024, 0, nullptr);
}

void errors_are_per_thread() {
  CHECK(lib().try_malloc(1024, 42, nullptr) == nullptr);
  const std::string mine = lib().error();
  std::string theirs;
  std::thread([&] {
    theirs = lib().error();  // nothing failed on this thread yet
    lib().try_malloc(1024, 43, nullptr);
  }).join();
  CHECK(theirs.empty());
  CHECK(lib().error() == mine);
}

void threads_allocate_and_free() {
  require_clean();
  std::vector<std::thread> threads;
  std::vector<int> bad(6, 0);
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([t, &bad] {
      std::vector<void*> live;
      for (int i = 0; i < 200; ++i) {
        void* p = lib().try_malloc(4096 * (1 + (i + t) % 7), 0, nullptr);
        if (p == nullptr) ++bad[t];
        live.push_back(p);
        if (live.size() > 8) {
          lib().free(live.front(), 0, 0, nullptr);
          live.erase(live.begin());
        }
      }
      for (void* p : live) lib().free(p, 0, 0, nullptr);
    });
  }
  for (auto& th : threads) th.join();
  for (int b : bad) CHECK(b == 0);
  CHECK(lib().stats().allocations == 0);
}

#define EVERY_BACKEND_CASES(suite)                                                       \
  TEST_CASE("malloc and free" * doctest::test_suite(suite)) { malloc_free_basics(); }       \
  TEST_CASE("size 0, NULL and negative sizes" * doctest::test_suite(suite)) { size_zero_and_null(); } \
  TEST_CASE("out of memory within the budget" * doctest::test_suite(suite)) { out_of_memory(); } \
  TEST_CASE("bad devices" * doctest::test_suite(suite)) { bad_device(); }                   \
  TEST_CASE("foreign and double frees" * doctest::test_suite(suite)) { foreign_and_double_frees(); } \
  TEST_CASE("record_stream orders the free" * doctest::test_suite(suite)) { record_stream_orders_the_free(); } \
  TEST_CASE("budgets and memory fractions" * doctest::test_suite(suite)) { budgets_and_fractions(); } \
  TEST_CASE("base_alloc, stats and mem_get_info" * doctest::test_suite(suite)) { base_alloc_and_stats(); } \
  TEST_CASE("errors are per thread" * doctest::test_suite(suite)) { errors_are_per_thread(); } \
  TEST_CASE("threads" * doctest::test_suite(suite)) { threads_allocate_and_free(); }

// --- backend:sim ------------------------------------------------------------------------------

EVERY_BACKEND_CASES("sim")

TEST_CASE("sim: the memory is real: bytes written read back" * doctest::test_suite("sim")) {
  auto* p = static_cast<unsigned char*>(lib().malloc(64 * 1024, 0, nullptr));
  for (int i = 0; i < 64 * 1024; ++i) p[i] = static_cast<unsigned char>(i * 7);
  bool same = true;
  for (int i = 0; i < 64 * 1024; ++i) same = same && p[i] == static_cast<unsigned char>(i * 7);
  CHECK(same);
  lib().free(p, 64 * 1024, 0, nullptr);
}

// --- backend:cuda over the fake CUDA runtime --------------------------------------------------

#if SPILLWAY_TEST_FAKE_CUDART
EVERY_BACKEND_CASES("cuda_fake")

TEST_CASE("cuda: segments come from the CUDA runtime and go back to it" * doctest::test_suite("cuda_fake")) {
  require_clean();
  const fake_cudart_counters before = fake_cudart_get_counters();
  void* p = lib().malloc(3 * M, 0, nullptr);
  void* q = lib().malloc(2 * M, 0, nullptr);  // the same 20 MiB segment
  fake_cudart_counters mid = fake_cudart_get_counters();
  CHECK(mid.mallocs == before.mallocs + 1);
  CHECK(mid.bytes_in_use == before.bytes_in_use + 20 * M);
  lib().free(p, 3 * M, 0, nullptr);
  lib().free(q, 2 * M, 0, nullptr);
  CHECK(fake_cudart_get_counters().frees == before.frees);  // cached, not freed
  lib().empty_cache();
  const fake_cudart_counters after = fake_cudart_get_counters();
  CHECK(after.frees == before.frees + 1);
  CHECK(after.bytes_in_use == before.bytes_in_use);
}

TEST_CASE("cuda: streams are the runtime's; out of device memory below the budget" * doctest::test_suite("cuda_fake")) {
  require_clean();
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  void* p = lib().malloc(1 * M, 0, s);  // allocated on a program stream
  lib().record_stream(p, nullptr);
  lib().free(p, 1 * M, 0, s);
  CHECK(lib().stats().allocations == 0);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);

  // Another user takes most of the device: spillway's budget is not the limit any more.
  void* hog = nullptr;
  REQUIRE(cudaMalloc(&hog, 230 * M) == cudaSuccess);
  lib().empty_cache();
  const std::string e = malloc_error(30 * M);
  CHECK(contains(e, "spillway: out of memory on device 0"));
  CHECK(contains(e, "free on the device"));
  std::size_t free_bytes = 0, total_bytes = 0;
  REQUIRE(lib().mem_get_info(0, &free_bytes, &total_bytes) == 0);
  CHECK(total_bytes == 64 * M);
  CHECK(free_bytes == FAKE_CUDART_CAPACITY - 230 * M);  // what the device has left
  CHECK(cudaFree(hog) == cudaSuccess);
}
#endif

// --- an invalid SPILLWAY_CONF -------------------------------------------------------------------

TEST_CASE("bad_conf: every allocation fails with the parser's message" * doctest::test_suite("bad_conf")) {
  const std::string e = malloc_error(1024);
  CHECK(contains(e, "SPILLWAY_CONF: unknown key \"bugdet\" in \"bugdet:1GiB\"; known keys"));
  CHECK(malloc_error(4096) == e);  // the first failure is final, and the same every time
  CHECK(lib().try_malloc(1024, 0, nullptr) == nullptr);
  CHECK(lib().error() == e);
  lib().init(1);  // reports it on stderr
  CHECK(lib().error() == e);
  spillway_stats s{};
  CHECK(lib().get_stats(0, &s, sizeof s) == -1);
  int on_stack = 0;
  lib().free(&on_stack, 4, 0, nullptr);  // never a crash
}
