// test_torch_allocator_history: torch.cuda.memory._record_memory_history() and the allocator trace
// trackers of spillway's c10 CUDAAllocator (torch_plugin/torch_allocator_history.hpp), on the
// simulated device.
//
// Proves: snapshots carry segments, blocks and the history's contexts and traces (ring size,
// skip_actions, RecordContext STATE / ALLOC / ALL); the recorder runs outside every lock (another
// thread's free, even a tensor deleter's, gets through while it runs); a failed record frees the
// allocation and leaves the trace paired; trackers see every event; segment events
// (SEGMENT_ALLOC/FREE/MAP/UNMAP) with the context of the call that caused them; each snapshot
// leaves a SNAPSHOT entry with the active bytes it listed, in the next snapshot's trace; entries
// carry the compile context and user metadata, and annotations reach the snapshot.
#include <doctest/doctest.h>

#include <c10/util/Exception.h>

#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "torch_allocator_fixture.hpp"

using namespace spillway::test;
using spillway::torch_plugin::torch_allocator;

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

TEST_CASE("compile contexts, user metadata and annotations, as PyTorch's allocator keeps them") {
  auto a = make();
  std::string compiled = "graph 1";
  a->pushCompileContext(compiled);  // history off: not kept
  a->setUserMetadata("step 7");     // kept whether or not history is on
  CHECK(a->getUserMetadata() == "step 7");
  a->recordAnnotation({{"stage", "ignored"}});
  a->recordHistory(true, nullptr, 100, cca::RecordContext::NEVER, true, {});
  a->raw_delete(a->raw_alloc(MiB));
  a->pushCompileContext(compiled);
  a->recordAnnotation({{"stage", "forward"}, {"name", "fc1"}});
  void* p = a->raw_alloc(MiB);
  a->popCompileContext();
  a->setUserMetadata("");
  a->raw_delete(p);
  a->popCompileContext();  // an empty stack: nothing to do
  const cca::SnapshotInfo snap = a->snapshot();
  const auto& trace = snap.device_traces.at(0);
  REQUIRE(trace.size() >= 6);
  CHECK(trace[0].action_ == TraceAction::SEGMENT_ALLOC);
  CHECK(trace[0].compile_context_ == "N/A");  // PyTorch's word for none
  CHECK(trace[0].user_metadata_ == "step 7");
  std::vector<const c10::CachingDeviceAllocator::TraceEntry*> allocs, frees;
  for (const auto& e : trace) {
    if (e.action_ == TraceAction::ALLOC) allocs.push_back(&e);
    if (e.action_ == TraceAction::FREE_REQUESTED) frees.push_back(&e);
  }
  REQUIRE(allocs.size() == 2);
  REQUIRE(frees.size() == 2);
  CHECK(allocs[0]->compile_context_ == "N/A");
  CHECK(allocs[1]->compile_context_ == "graph 1");  // the second allocation, in the context
  CHECK(allocs[1]->user_metadata_ == "step 7");
  CHECK(frees[1]->compile_context_ == "N/A");      // its free, after the pop and the new metadata
  CHECK(frees[1]->user_metadata_.empty());
  REQUIRE(snap.external_annotations.size() == 1);  // the one made while history was on
  const auto& note = snap.external_annotations[0];
  CHECK(note.device_ == 0);
  CHECK(note.metadata_.at("stage") == "forward");
  CHECK(note.metadata_.at("name") == "fc1");
  CHECK(note.time_.t_ >= trace.front().time_.t_);
  a->recordHistory(true, nullptr, 100, cca::RecordContext::NEVER, false, {});
  CHECK(a->snapshot().external_annotations.empty());  // every recordHistory call empties them
}

TEST_CASE("each snapshot leaves a SNAPSHOT entry with the active bytes, for the next trace and trackers") {
  auto a = make();
  std::vector<TraceAction> tracked;
  a->attachAllocatorTraceTracker(
      [&](const c10::CachingDeviceAllocator::TraceEntry& e) { tracked.push_back(e.action_); });
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::STATE, true, {});
  void* p = a->raw_alloc(3 * MiB);
  const auto first = a->snapshot().device_traces[0];
  REQUIRE_FALSE(first.empty());
  CHECK(first.back().action_ == TraceAction::ALLOC);  // its own entry follows the traces it read
  CHECK(tracked.back() == TraceAction::SNAPSHOT);
  const auto second = a->snapshot().device_traces[0];
  REQUIRE(second.size() == first.size() + 1);
  CHECK(second.back().action_ == TraceAction::SNAPSHOT);
  CHECK(second.back().addr_ == 0);
  CHECK(second.back().size_ == 3 * MiB);  // the active bytes the first snapshot listed
  CHECK(second.back().context_ == nullptr);

  // A private pool's snapshot lists nothing, and says so; skip_actions takes "snapshot".
  (void)a->snapshot({1, 1});
  CHECK(a->snapshot().device_traces[0].back().size_ == 0);
  a->recordHistory(true, &record_tag, 100, cca::RecordContext::STATE, true, {"snapshot"});
  (void)a->snapshot();
  CHECK(a->snapshot().device_traces[0].empty());
  a->raw_delete(p);
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
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

