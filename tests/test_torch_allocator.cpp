// test_torch_allocator: spillway's c10 CUDAAllocator (torch_plugin/torch_allocator.hpp), built
// against the installed torch, driven on the simulated device.
//
// Proves what PyTorch relies on: DataPtrs whose deleter frees, size 0, stats and their resets in
// c10's layout, snapshots with memory-history contexts and traces, OOM as c10::OutOfMemoryError
// with the observers called, cacheInfo, memory fraction as a budget, getBaseAllocation, the
// memory info torch reports, and a NotImplementedError naming each unsupported feature. Every
// failure path leaves the allocator's state unchanged.
// Not here (needs a GPU): recordStream on real CUDA streams, memcpyAsync, enablePeerAccess, and
// installation into a process that runs CUDA kernels (bench/gpu_suite.sh runs those).
#include <doctest/doctest.h>

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <thread>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "config_string.hpp"
#include "torch_allocator.hpp"

namespace cca = c10::cuda::CUDACachingAllocator;
using spillway::parse_config;
using spillway::stream_ref;
using spillway::torch_plugin::torch_allocator;
using spillway::torch_plugin::torch_context;
using TraceAction = c10::CachingDeviceAllocator::TraceEntry::Action;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

torch_context sim_context() {
  return {[] { return c10::DeviceIndex{0}; }, [](c10::DeviceIndex) { return stream_ref{}; }};
}

std::unique_ptr<torch_allocator> make(const std::string& conf = "budget:64MiB") {
  return std::make_unique<torch_allocator>(parse_config("backend:sim,sim_capacity:1GiB," + conf),
                                           sim_context());
}

struct tagged_context : c10::GatheredContext {
  explicit tagged_context(int t) : tag(t) {}
  int tag;
};
int next_tag = 0;
std::shared_ptr<c10::GatheredContext> record_tag() { return std::make_shared<tagged_context>(++next_tag); }

std::int64_t allocated_now(torch_allocator& a) {
  return a.getDeviceStats(0).allocated_bytes[0].current;
}

}  // namespace

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

TEST_CASE("snapshot: segments and blocks, with history contexts and traces") {
  auto a = make();
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::ALL, true, {});
  CHECK(a->isHistoryEnabled());
  void* p = a->raw_alloc(3 * MiB);
  void* q = a->raw_alloc(5 * MiB);
  const int tag_of_p = next_tag - 1;
  a->raw_delete(q);

  auto snap = a->snapshot();
  REQUIRE(snap.segments.size() >= 1);
  const auto& seg = snap.segments[0];
  CHECK(seg.device == 0);
  CHECK(seg.is_large);
  CHECK(seg.allocated_size == 3 * MiB);
  std::size_t tiled = 0;
  int live = 0;
  for (const auto& b : seg.blocks) {
    tiled += b.size;
    if (b.allocated) {
      ++live;
      auto ctx = std::dynamic_pointer_cast<tagged_context>(b.context_when_allocated);
      REQUIRE(ctx != nullptr);
      CHECK(ctx->tag == tag_of_p);
    }
  }
  CHECK(tiled == seg.total_size);
  CHECK(live == 1);

  REQUIRE(snap.device_traces.size() == 1);
  const auto& trace = snap.device_traces[0];
  REQUIRE(trace.size() == 5);
  // p needed a segment: SEGMENT_ALLOC first, carrying p's context (gathered once, before the
  // device lock, as PyTorch gathers it), which the snapshot's segment carries too.
  CHECK(trace[0].action_ == TraceAction::SEGMENT_ALLOC);
  CHECK(trace[0].addr_ == seg.address);
  CHECK(trace[0].size_ == 20 * MiB);
  CHECK(trace[0].context_ != nullptr);
  CHECK(trace[0].context_ == trace[1].context_);
  CHECK(seg.context_when_allocated == trace[0].context_);
  CHECK(trace[1].action_ == TraceAction::ALLOC);
  CHECK(trace[1].addr_ == reinterpret_cast<std::size_t>(p));
  CHECK(trace[1].size_ == 3 * MiB);
  CHECK(trace[2].action_ == TraceAction::ALLOC);  // q fits in p's segment: no segment event
  // A free's entries carry the allocation's requested size and stream, as PyTorch's do (its
  // memory viewer rebuilds freed blocks from them).
  for (int i : {3, 4}) {
    CAPTURE(i);
    CHECK(trace[i].addr_ == reinterpret_cast<std::size_t>(q));
    CHECK(trace[i].size_ == 5 * MiB);
    CHECK(trace[i].stream_ == trace[2].stream_);
  }
  CHECK(trace[3].action_ == TraceAction::FREE_REQUESTED);
  CHECK(trace[4].action_ == TraceAction::FREE_COMPLETED);
  CHECK(trace[3].context_ != nullptr);  // ALL: frees carry a context too
  CHECK(trace[4].context_ == trace[3].context_);

  // skip_actions and the ring size.
  a->recordHistory(true, &record_tag, 2, cca::RecordContext::STATE, true, {"free_completed"});
  for (int i = 0; i < 3; ++i) a->raw_delete(a->raw_alloc(MiB));
  auto ring = a->snapshot().device_traces[0];
  REQUIRE(ring.size() == 2);
  CHECK(ring[0].action_ == TraceAction::ALLOC);
  CHECK(ring[1].action_ == TraceAction::FREE_REQUESTED);
  CHECK(ring[0].context_ == nullptr);  // STATE keeps contexts for live blocks only

  // ALLOC: entries carry contexts, a free's being its allocation's (none is gathered at frees).
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::ALLOC, true, {});
  void* r = a->raw_alloc(MiB);
  const int tag_of_r = next_tag;
  a->raw_delete(r);
  auto alloc_ring = a->snapshot().device_traces[0];
  REQUIRE(alloc_ring.size() == 3);
  CHECK(next_tag == tag_of_r);
  for (const auto& entry : alloc_ring) {
    auto ctx = std::dynamic_pointer_cast<tagged_context>(entry.context_);
    REQUIRE(ctx != nullptr);
    CHECK(ctx->tag == tag_of_r);
  }

  CHECK_THROWS_AS(a->recordHistory(true, &record_tag, 2, cca::RecordContext::STATE, true, {"fly"}),
                  c10::Error);
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
  CHECK_FALSE(a->isHistoryEnabled());
  CHECK(a->snapshot().device_traces[0].empty());
  CHECK(a->snapshot({0, 0}, false).device_traces.empty());
  a->raw_delete(p);
}

namespace {
// For the recorder cases below: the recorder is a plain function, so its state is global.
torch_allocator* probed = nullptr;
void* probe_target = nullptr;
bool probe_finished = false;
bool recorder_fails = false;

// Frees probe_target from another thread while this one is inside the recorder, and sees whether
// that free got through. torch's recorder takes the GIL: a free (from Python, holding the GIL)
// waiting on a lock the recorder's thread holds would deadlock the two.
std::shared_ptr<c10::GatheredContext> probing_recorder() {
  if (void* target = std::exchange(probe_target, nullptr); target != nullptr) {
    auto other = std::async(std::launch::async, [target] { probed->raw_delete(target); });
    probe_finished = other.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  }
  if (recorder_fails) throw std::runtime_error("recorder failed");
  return record_tag();
}
}  // namespace

TEST_CASE("the recorder runs outside the history's lock: another thread's free gets through") {
  auto a = make();
  probed = a.get();
  a->recordHistory(true, &probing_recorder, 100, cca::RecordContext::ALL, true, {});
  probe_target = a->raw_alloc(MiB);
  void* p = a->raw_alloc(2 * MiB);  // its context is gathered while the other thread frees
  CHECK(probe_finished);
  CHECK(allocated_now(*a) == static_cast<std::int64_t>(2 * MiB));
  a->raw_delete(p);
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
}

namespace {
// Destroys `other_tensor_memory` from another thread while this one is inside the recorder, as a
// free: torch's recorder takes the GIL, and that thread may hold it while it frees a tensor.
c10::DataPtr other_tensor_memory;
bool other_free_finished = false;
std::shared_ptr<c10::GatheredContext> freeing_recorder() {
  if (other_tensor_memory) {
    // Detached: should the free be held up, it finishes once this one has, and the case fails
    // instead of hanging.
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> finished = done->get_future();
    std::thread([done] {
      other_tensor_memory.clear();
      done->set_value();
    }).detach();
    other_free_finished = finished.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  }
  return record_tag();
}
}  // namespace

TEST_CASE("a tensor's deleter running the recorder does not hold up another thread's deleter") {
  // The allocator is not installed: the deleter looks for it among the live ones, under a lock
  // that a free which runs the recorder (RecordContext ALL) must not hold exclusively.
  auto a = make();
  c10::DataPtr mine = a->allocate(MiB);
  other_tensor_memory = a->allocate(MiB);
  a->recordHistory(true, &freeing_recorder, 100, cca::RecordContext::ALL, true, {});
  mine.clear();  // the recorder runs inside this deleter and frees the other tensor meanwhile
  CHECK(other_free_finished);
  CHECK(allocated_now(*a) == 0);
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
}

TEST_CASE("an allocation whose record fails is freed, and the error reaches the caller") {
  auto a = make();
  a->recordHistory(true, &probing_recorder, 100, cca::RecordContext::STATE, true, {});
  recorder_fails = true;
  CHECK_THROWS_WITH_AS(a->raw_alloc(MiB), "recorder failed", std::runtime_error);
  recorder_fails = false;
  CHECK(allocated_now(*a) == 0);
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
}

TEST_CASE("trace trackers see every event, segments' included") {
  auto a = make();
  std::vector<c10::CachingDeviceAllocator::TraceEntry> events;
  a->attachAllocatorTraceTracker([&](const c10::CachingDeviceAllocator::TraceEntry& e) { events.push_back(e); });
  void* p = a->raw_alloc(MiB);
  a->raw_delete(p);
  a->emptyCache();
  // What NCCL's register hook reads: a segment's range at SEGMENT_ALLOC and SEGMENT_FREE.
  REQUIRE(events.size() == 5);
  const std::vector<TraceAction> expected = {TraceAction::SEGMENT_ALLOC, TraceAction::ALLOC,
                                             TraceAction::FREE_REQUESTED, TraceAction::FREE_COMPLETED,
                                             TraceAction::SEGMENT_FREE};
  for (std::size_t i = 0; i < events.size(); ++i) {
    CAPTURE(i);
    CHECK(events[i].action_ == expected[i]);
    CHECK(events[i].device_ == 0);
    CHECK(events[i].context_ == nullptr);  // no history: no contexts
  }
  CHECK(events[0].addr_ == reinterpret_cast<std::size_t>(p));  // the small pool's 2 MiB segment
  CHECK(events[0].size_ == 2 * MiB);
  CHECK(events[4].addr_ == events[0].addr_);
  CHECK(events[4].size_ == events[0].size_);
}

TEST_CASE("segment events in the history: a segment's context from its allocation to its release") {
  auto a = make();
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::ALLOC, true, {"segment_map"});
  void* p = a->raw_alloc(30 * MiB);  // a segment of its own
  const int tag_of_p = next_tag;
  a->raw_delete(p);
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::ALLOC, false, {});
  a->emptyCache();  // no allocation: the release carries the segment's context
  const auto trace = a->snapshot().device_traces[0];
  REQUIRE(trace.size() == 5);
  CHECK(trace[0].action_ == TraceAction::SEGMENT_ALLOC);
  CHECK(trace[4].action_ == TraceAction::SEGMENT_FREE);
  CHECK(trace[4].addr_ == reinterpret_cast<std::size_t>(p));
  CHECK(trace[4].size_ == 30 * MiB);
  for (int i : {0, 4}) {
    CAPTURE(i);
    auto ctx = std::dynamic_pointer_cast<tagged_context>(trace[i].context_);
    REQUIRE(ctx != nullptr);
    CHECK(ctx->tag == tag_of_p);
  }
  CHECK(next_tag == tag_of_p);  // nothing more was gathered: not at frees, not at the release

  // STATE: entries carry no contexts, the snapshot's live segments do.
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::STATE, true, {});
  void* q = a->raw_alloc(30 * MiB);
  const auto snap = a->snapshot();
  REQUIRE(snap.segments.size() == 1);
  auto seg_ctx = std::dynamic_pointer_cast<tagged_context>(snap.segments[0].context_when_allocated);
  REQUIRE(seg_ctx != nullptr);
  CHECK(seg_ctx->tag == next_tag);
  CHECK(snap.device_traces[0].front().context_ == nullptr);
  a->raw_delete(q);
  a->emptyCache();

  // skip_actions takes the segment actions too.
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::STATE, true, {"segment_alloc", "segment_free"});
  a->raw_delete(a->raw_alloc(30 * MiB));
  a->emptyCache();
  const auto skipped = a->snapshot();
  CHECK(skipped.device_traces[0].size() == 3);  // alloc, free requested, free completed
  for (const auto& entry : skipped.device_traces[0]) {
    CHECK(entry.action_ != TraceAction::SEGMENT_ALLOC);
    CHECK(entry.action_ != TraceAction::SEGMENT_FREE);
  }
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
}

TEST_CASE("segment events carry the context of the call that caused them") {
  auto a = make();
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::ALL, true, {});
  a->raw_delete(a->raw_alloc(30 * MiB));
  a->emptyCache();  // with ALL, as in PyTorch: the empty_cache call's context, not the allocation's
  const int tag_of_empty_cache = next_tag;
  const auto trace = a->snapshot().device_traces[0];
  REQUIRE(trace.back().action_ == TraceAction::SEGMENT_FREE);
  auto ctx = std::dynamic_pointer_cast<tagged_context>(trace.back().context_);
  REQUIRE(ctx != nullptr);
  CHECK(ctx->tag == tag_of_empty_cache);

  // What an OOM observer releases is not the failed allocation's doing: no context of it (what
  // the allocation released itself, before failing, carries its context, as in PyTorch).
  a->setMemoryFraction(40.0 / 1024, 0);
  void* held = a->raw_alloc(30 * MiB);
  a->attachOutOfMemoryObserver([&](int64_t, size_t, size_t, size_t) {
    a->raw_delete(std::exchange(held, nullptr));
    a->emptyCache();
  });
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::ALLOC, true, {});
  CHECK_THROWS_AS(a->raw_alloc(30 * MiB), c10::OutOfMemoryError);
  const int tag_of_failed = next_tag;
  CHECK(held == nullptr);
  const auto after = a->snapshot().device_traces[0];
  REQUIRE_FALSE(after.empty());
  CHECK(after.back().action_ == TraceAction::SEGMENT_FREE);  // held's, by the observer
  auto by_observer = std::dynamic_pointer_cast<tagged_context>(after.back().context_);
  CHECK((by_observer == nullptr || by_observer->tag != tag_of_failed));
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
}

TEST_CASE("a tracker that fails an allocation leaves the trace paired and no context behind") {
  auto a = make();
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::STATE, true, {});
  bool fail = true;
  a->attachAllocatorTraceTracker([&](const c10::CachingDeviceAllocator::TraceEntry& e) {
    if (fail && e.action_ == TraceAction::ALLOC) throw std::runtime_error("tracker failed");
  });
  CHECK_THROWS_WITH_AS(a->raw_alloc(MiB), "tracker failed", std::runtime_error);
  CHECK(allocated_now(*a) == 0);
  const auto trace = a->snapshot().device_traces[0];
  std::vector<TraceAction> actions;
  for (const auto& entry : trace) actions.push_back(entry.action_);
  CHECK(actions == std::vector<TraceAction>{TraceAction::SEGMENT_ALLOC, TraceAction::ALLOC,
                                            TraceAction::FREE_REQUESTED, TraceAction::FREE_COMPLETED});
  fail = false;
  void* p = a->raw_alloc(MiB);  // the same address again: its context is its own
  const int tag_of_p = next_tag;
  auto snap = a->snapshot();
  for (const auto& seg : snap.segments) {
    for (const auto& b : seg.blocks) {
      if (!b.allocated) continue;
      auto ctx = std::dynamic_pointer_cast<tagged_context>(b.context_when_allocated);
      REQUIRE(ctx != nullptr);
      CHECK(ctx->tag == tag_of_p);
    }
  }
  a->raw_delete(p);
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
}

TEST_CASE("segment events with expandable segments: SEGMENT_MAP and SEGMENT_UNMAP") {
  auto a = make("budget:64MiB,expandable_segments:true");
  std::vector<c10::CachingDeviceAllocator::TraceEntry> events;
  a->attachAllocatorTraceTracker([&](const c10::CachingDeviceAllocator::TraceEntry& e) {
    if (e.action_ >= TraceAction::SEGMENT_ALLOC && e.action_ <= TraceAction::SEGMENT_UNMAP) events.push_back(e);
  });
  void* p = a->raw_alloc(6 * MiB);
  a->raw_delete(p);
  a->emptyCache();
  REQUIRE(events.size() == 2);
  CHECK(events[0].action_ == TraceAction::SEGMENT_MAP);
  CHECK(events[0].addr_ == reinterpret_cast<std::size_t>(p));
  CHECK(events[1].action_ == TraceAction::SEGMENT_UNMAP);
  CHECK(events[1].addr_ == events[0].addr_);
  CHECK(events[1].size_ == events[0].size_);
  CHECK(events[0].size_ >= 6 * MiB);
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
