// test_torch_allocator: spillway's c10 CUDAAllocator (torch_plugin/torch_allocator.hpp), built
// against the installed torch, driven on the simulated device.
//
// Proves what PyTorch relies on: DataPtrs whose deleter frees, size 0, stats and their resets in
// c10's layout, OOM as c10::OutOfMemoryError with the observers called, cacheInfo, memory fraction
// as a budget, getBaseAllocation, the memory info torch reports, and a NotImplementedError naming
// each unsupported feature, and the allocations, frees and out of memory that torch's profiler
// records. Every failure path leaves the allocator's state unchanged. (Memory
// history, snapshots' traces and trace trackers: test_torch_allocator_history.cpp.)
// Not here (needs a GPU): recordStream on real CUDA streams, memcpyAsync, enablePeerAccess, and
// installation into a process that runs CUDA kernels (bench/gpu_suite.sh runs those).
#include <doctest/doctest.h>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "torch_allocator_fixture.hpp"

using namespace spillway::test;
using spillway::torch_plugin::torch_allocator;

TEST_CASE("DataPtrs: the deleter frees, size 0 is null, the device is CUDA") {
  auto a = make();
  {
    c10::DataPtr p = a->allocate(3 * MiB);
    CHECK(p.get() != nullptr);
    CHECK(p.device() == c10::Device(c10::DeviceType::CUDA, 0));
    CHECK(static_cast<bool>(p.get_deleter() == a->raw_deleter()));
    CHECK(allocated_now(*a) == static_cast<std::int64_t>(3 * MiB));
    CHECK(a->getDeviceStats(0).requested_bytes[0].current == static_cast<std::int64_t>(3 * MiB));
  }
  CHECK(allocated_now(*a) == 0);
  c10::DataPtr empty = a->allocate(0);
  CHECK(empty.get() == nullptr);
  void* raw = a->raw_alloc(1000);
  CHECK(allocated_now(*a) == 1024);
  a->raw_delete(raw);
  a->raw_delete(nullptr);  // a no-op, as cudaFree(nullptr)
  CHECK(allocated_now(*a) == 0);
  CHECK(a->name() == "spillway");
}

TEST_CASE("stats in c10's layout, and their resets") {
  auto a = make();
  void* p = a->raw_alloc(10 * MiB);
  void* q = a->raw_alloc(100);
  auto s = a->getDeviceStats(0);
  CHECK(s.allocation[0].current == 2);
  CHECK(s.allocation[1].current == 1);  // small pool
  CHECK(s.allocation[2].current == 1);  // large pool
  CHECK(s.reserved_bytes[0].current >= static_cast<std::int64_t>(10 * MiB + 512));
  CHECK(s.num_device_alloc == s.segment[0].current);
  a->raw_delete(p);
  a->raw_delete(q);
  s = a->getDeviceStats(0);
  CHECK(s.allocated_bytes[0].peak >= static_cast<std::int64_t>(10 * MiB));
  a->resetPeakStats(0);
  CHECK(a->getDeviceStats(0).allocated_bytes[0].peak == 0);
  CHECK(a->getDeviceStats(0).allocation[0].allocated == 2);
  a->resetAccumulatedStats(0);
  CHECK(a->getDeviceStats(0).allocation[0].allocated == 0);
  CHECK_THROWS_AS(a->getDeviceStats(1), c10::IndexError);
}

TEST_CASE("out of memory: c10::OutOfMemoryError, observers called, nothing changed") {
  auto a = make("budget:16MiB");
  a->recordHistory(true, nullptr, 100, cca::RecordContext::STATE, true, {});
  void* p = a->raw_alloc(4 * MiB);
  int calls = 0;
  std::size_t seen_allocated = 0, seen_total = 0, seen_free = 0;
  // As PyTorch's: the rounded request, the memory the process may use (the budget) and the
  // device's free memory.
  a->attachOutOfMemoryObserver([&](int64_t device, size_t allocated, size_t total, size_t free) {
    ++calls;
    CHECK(device == 0);
    seen_allocated = allocated;
    seen_total = total;
    seen_free = free;
  });
  const auto before = a->getDeviceStats(0);
  try {
    (void)a->allocate(64 * MiB);
    FAIL("no error");
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what_without_backtrace();
    CHECK(what.find("CUDA out of memory") != std::string::npos);
    CHECK(what.find("budget 16.00 MiB") != std::string::npos);
  }
  CHECK(calls == 1);
  CHECK(seen_allocated == 64 * MiB);
  CHECK(seen_total == 16 * MiB);
  CHECK(seen_free > 0);
  const auto after = a->getDeviceStats(0);
  CHECK(after.num_ooms == before.num_ooms + 1);
  CHECK(after.allocated_bytes[0].current == before.allocated_bytes[0].current);
  const auto trace = a->snapshot().device_traces[0];
  REQUIRE(trace.size() == 3);
  CHECK(trace[0].action_ == TraceAction::SEGMENT_ALLOC);  // p's segment
  CHECK(trace[1].action_ == TraceAction::ALLOC);
  CHECK(trace[2].action_ == TraceAction::OOM);
  CHECK(trace[2].size_ == 64 * MiB);    // what PyTorch's memory viewer prints as requested
  CHECK(trace[2].addr_ == seen_free);  // PyTorch writes the device's free memory there
  // time_us, as PyTorch's snapshot() gives it: microseconds since the epoch, not clock ticks.
  const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  for (const auto& entry : trace) {
    CHECK(std::llabs(static_cast<long long>(entry.time_.t_) - static_cast<long long>(now_us)) <
          60'000'000);
  }

  // A request over what any device could hold is out of memory too, as in PyTorch.
  try {
    (void)a->allocate(std::size_t{1} << 60);
    FAIL("no error");
  } catch (const c10::OutOfMemoryError& e) {
    CHECK(std::string(e.what_without_backtrace()).find("CUDA out of memory") != std::string::npos);
  }
  CHECK(calls == 2);
  CHECK(seen_allocated == std::size_t{1} << 60);
  CHECK(seen_total == 16 * MiB);
  CHECK(seen_free > 0);  // the device as it is, not a blank report
  // ... and counted as one, as PyTorch counts it; reset with the other accumulated counts.
  CHECK(a->getDeviceStats(0).num_ooms == before.num_ooms + 2);
  CHECK(a->device_stats(0).num_ooms == before.num_ooms + 2);  // spillway.stats()
  a->resetAccumulatedStats(0);
  CHECK(a->getDeviceStats(0).num_ooms == 0);
  a->raw_delete(p);
}

namespace {
// What torch's profiler is told (profile_memory): (ptr, bytes, allocated, reserved) per call, and
// the out-of-memory reports (bytes, allocated, reserved).
struct profiler_record final : c10::MemoryReportingInfoBase {
  struct usage {
    void* ptr;
    std::int64_t bytes;
    std::size_t allocated, reserved;
  };
  std::vector<usage> uses, ooms;
  void reportMemoryUsage(void* ptr, int64_t bytes, size_t allocated, size_t reserved,
                         c10::Device device) override {
    CHECK(device == c10::Device(c10::DeviceType::CUDA, 0));
    uses.push_back({ptr, bytes, allocated, reserved});
  }
  void reportOutOfMemory(int64_t bytes, size_t allocated, size_t reserved, c10::Device) override {
    ooms.push_back({nullptr, bytes, allocated, reserved});
  }
  bool memoryProfilingEnabled() const override { return true; }
};
}  // namespace

TEST_CASE("torch's profiler is told of every allocation, free and out of memory") {
  auto a = make("budget:64MiB");
  auto record = std::make_shared<profiler_record>();
  {
    const c10::DebugInfoGuard profiling(c10::DebugInfoKind::PROFILER_STATE, record);
    void* p = a->raw_alloc(1000);      // a 1024-byte block of a 2 MiB segment
    void* q = a->raw_alloc(3 * MiB);   // a 20 MiB segment
    a->raw_delete(p);
    CHECK_THROWS_AS(a->raw_alloc(128 * MiB), c10::OutOfMemoryError);
    a->raw_delete(q);
  }
  void* unrecorded = a->raw_alloc(1000);  // the profiler has stopped: nothing more
  a->raw_delete(unrecorded);
  REQUIRE(record->uses.size() == 4);
  const auto& u = record->uses;
  CHECK(u[0].bytes == 1024);  // the block's rounded size, as PyTorch's allocator reports
  CHECK(u[0].allocated == 1024);
  CHECK(u[0].reserved == 2 * MiB);
  CHECK(u[1].bytes == static_cast<std::int64_t>(3 * MiB));
  CHECK(u[1].allocated == 1024 + 3 * MiB);
  CHECK(u[1].reserved == 22 * MiB);
  CHECK(u[2].ptr == u[0].ptr);
  CHECK(u[2].bytes == -1024);
  CHECK(u[2].allocated == 3 * MiB);
  CHECK(u[3].ptr == u[1].ptr);
  CHECK(u[3].bytes == -static_cast<std::int64_t>(3 * MiB));
  CHECK(u[3].allocated == 0);
  REQUIRE(record->ooms.size() == 1);
  CHECK(record->ooms[0].bytes == static_cast<std::int64_t>(128 * MiB));
  CHECK(record->ooms[0].allocated == 3 * MiB);
}

TEST_CASE("cacheInfo, empty_cache, memory info, memory fraction") {
  auto a = make("budget:64MiB");
  size_t largest = 0;
  a->cacheInfo(0, &largest);
  CHECK(largest == 64 * MiB);  // nothing cached: the budget's headroom
  a->raw_delete(a->raw_alloc(8 * MiB));
  largest = 0;
  a->cacheInfo(0, &largest);
  // As PyTorch: the larger of a new segment's room and the cache (8 MiB took a 20 MiB segment).
  CHECK(largest == 44 * MiB);
  a->setMemoryFraction(20.0 / 1024, 0);  // the budget is what is reserved: no room for a segment
  largest = 0;
  a->cacheInfo(0, &largest);
  CHECK(largest == 20 * MiB);  // the cached block
  largest = 100 * MiB;        // the caller's guess counts, as in PyTorch
  a->cacheInfo(0, &largest);
  CHECK(largest == 100 * MiB);
  a->setMemoryFraction(64.0 / 1024, 0);
  auto [free, total] = a->getMemoryInfo(0);
  CHECK(total == 64 * MiB);
  CHECK(free == 64 * MiB);
  a->emptyCache();
  CHECK(a->getDeviceStats(0).reserved_bytes[0].current == 0);
  CHECK_THROWS_AS(a->emptyCache({1, 2}), c10::NotImplementedError);

  a->setMemoryFraction(0.5, 0);
  CHECK(a->device(0).budget() == 512 * MiB);
  CHECK(a->getMemoryFraction(0) == doctest::Approx(0.5));
  CHECK_THROWS_AS(a->setMemoryFraction(1.5, 0), c10::ValueError);
  CHECK(a->device(0).budget() == 512 * MiB);
  void* p = a->raw_alloc(40 * MiB);
  // Below live memory, as PyTorch takes it: set, and what needs a new segment fails until frees.
  a->setMemoryFraction(0.01, 0);
  CHECK(a->device(0).budget() == static_cast<std::size_t>(0.01 * 1024 * MiB));
  CHECK_THROWS_AS(a->raw_alloc(4 * MiB), c10::OutOfMemoryError);
  a->raw_delete(p);
  void* fits = a->raw_alloc(4 * MiB);
  CHECK(fits != nullptr);
  a->raw_delete(fits);
  a->setMemoryFraction(0.0, 0);  // no new memory at all
  CHECK(a->device(0).budget() == 1);
  a->emptyCache();
  CHECK_THROWS_AS(a->raw_alloc(4 * MiB), c10::OutOfMemoryError);
  a->setMemoryFraction(1.0, 0);
  CHECK(a->getMemoryFraction(0) == doctest::Approx(1.0));
}

TEST_CASE("getBaseAllocation and foreign pointers") {
  auto a = make();
  void* p = a->raw_alloc(MiB);
  void* q = a->raw_alloc(MiB);
  size_t size = 0;
  void* base = a->getBaseAllocation(q, &size);
  CHECK(base == p);  // 1 MiB is small-pool: both split from one 2 MiB segment, p first
  CHECK(size == 2 * MiB);
  int local = 0;
  CHECK_THROWS_AS(a->getBaseAllocation(&local, &size), c10::Error);
  CHECK_THROWS_AS(a->raw_delete(&local), c10::Error);
  const auto before = a->getDeviceStats(0);
  CHECK(a->release(&local) == spillway::free_result::foreign);
  CHECK(a->getDeviceStats(0).allocated_bytes[0].current == before.allocated_bytes[0].current);
  a->raw_delete(p);
  a->raw_delete(q);
  // Freed twice: an error, as PyTorch's raw_delete raises for an invalid device pointer (the
  // DataPtr deleter, which cannot throw, only reports it). Nothing changes.
  const auto freed = a->getDeviceStats(0);
  try {
    a->raw_delete(q);
    FAIL("no exception");
  } catch (const c10::Error& e) {
    CHECK(std::string(e.what_without_backtrace()).find("not a live allocation") != std::string::npos);
  }
  CHECK(a->getDeviceStats(0).allocated_bytes[0].current == freed.allocated_bytes[0].current);
}

TEST_CASE("expandable segments are listed per stream") {
  auto a = make("budget:64MiB,expandable_segments:True");
  CHECK(a->getExpandableSegmentSizes(0).empty());
  void* p = a->raw_alloc(6 * MiB);
  auto sizes = a->getExpandableSegmentSizes(0);
  REQUIRE(sizes.size() == 1);
  CHECK_FALSE(sizes[0].is_small_pool);
  CHECK(sizes[0].total_size >= 6 * MiB);
  // A free middle unmapped by empty_cache leaves two runs of one segment: still one entry, of
  // what is mapped (sim granules: 2 MiB).
  void* q = a->raw_alloc(2 * MiB);
  void* r = a->raw_alloc(2 * MiB);
  a->raw_delete(q);
  a->emptyCache();
  REQUIRE(a->snapshot().segments.size() == 2);
  sizes = a->getExpandableSegmentSizes(0);
  REQUIRE(sizes.size() == 1);
  CHECK(sizes[0].total_size == static_cast<std::size_t>(a->getDeviceStats(0).reserved_bytes[0].current));
  a->raw_delete(r);
  a->raw_delete(p);
}

TEST_CASE("unsupported features raise NotImplementedError naming the feature") {
  auto a = make();
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const c10::NotImplementedError& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  CHECK(message([&] { a->beginAllocateToPool(0, {1, 1}, nullptr); }).find("beginAllocateToPool") !=
        std::string::npos);
  CHECK(message([&] { a->shareIpcHandle(nullptr); }).find("CUDA IPC") != std::string::npos);
  CHECK(message([&] { a->getIpcDevPtr("x"); }).find("CUDA IPC") != std::string::npos);
  CHECK(message([&] { a->getCheckpointState(0, {1, 1}); }).find("getCheckpointState") !=
        std::string::npos);
  CHECK(message([&] { a->setCheckpointPoolState(0, nullptr); }).find("setCheckpointPoolState") !=
        std::string::npos);
  // torch.cuda.MemPool's calls (PyTorch's defaults raised RuntimeError, not naming spillway's limit).
  CHECK(message([&] { a->createOrIncrefPool(0, {1, 1}, nullptr); }).find("createOrIncrefPool") !=
        std::string::npos);
  CHECK(message([&] { a->getPoolUseCount(0, {1, 1}); }).find("getPoolUseCount") != std::string::npos);
  CHECK(message([&] { a->setUseOnOOM(0, {1, 1}, true); }).find("setUseOnOOM") != std::string::npos);
  CHECK(message([&] { a->setNoSplit(0, {1, 1}); }).find("setNoSplit") != std::string::npos);
  CHECK(message([&] { a->checkPoolLiveAllocations(0, {1, 1}, {}); }).find("checkPoolLiveAllocations") !=
        std::string::npos);
  a->endAllocateToPool(0, {1, 1});  // never begun: nothing to do, no error
  a->releasePool(0, {1, 1});
}

TEST_CASE("installing a null allocator is a ValueError, and nothing is installed") {
  const torch_allocator* before = spillway::torch_plugin::installed();
  try {
    spillway::torch_plugin::install(nullptr);
    FAIL("no exception");
  } catch (const c10::ValueError& e) {
    CHECK(std::string(e.what_without_backtrace()).find("the allocator is null") != std::string::npos);
  }
  CHECK(spillway::torch_plugin::installed() == before);
}

TEST_CASE("init checks the device count; enable(false) keeps nothing cached") {
  auto a = make();
  CHECK_FALSE(a->initialized());
  CHECK_THROWS_AS(a->init(2), c10::Error);
  a->init(1);
  CHECK(a->initialized());
  a->enable(false);
  CHECK_FALSE(a->isEnabled());
  a->raw_delete(a->raw_alloc(MiB));
  CHECK(a->getDeviceStats(0).reserved_bytes[0].current == 0);
  a->enable(true);
  a->raw_delete(a->raw_alloc(MiB));
  CHECK(a->getDeviceStats(0).reserved_bytes[0].current > 0);
}
