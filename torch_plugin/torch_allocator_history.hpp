// torch_allocator_history: torch.cuda.memory._record_memory_history() for torch_allocator, and the
// allocator trace trackers torch attaches.
//
// Contract
// - While enabled, every allocation, free request, completed free and out-of-memory that passes
//   through torch_allocator is kept as a c10 TraceEntry in a ring of at most max_entries per device
//   (oldest dropped first), with the context torch's recorder gathers (Python and C++ stacks)
//   when `when` asks for one. Actions named in skip_actions are not kept.
// - Segment events (segment_alloc, segment_free, map, unmap) happen inside spillway's core and are
//   not in the trace; the snapshot's segments show the resulting state.
// - Every attached tracker sees every entry, enabled or not, as PyTorch's allocator does.
// - Contexts follow PyTorch's allocator: an allocation's (RecordContext STATE or more) is kept for
//   the snapshot's BlockInfo::context_when_allocated; a free's entries carry the context gathered
//   at the free (ALL) or else the allocation's; entries carry contexts only with ALLOC or more.
// - FREE_COMPLETED comes from the device allocator's on_free_completed, when the block may be
//   handed out again (at once, or after the events of the other streams that used it), with the
//   device lock held: record_free_completed gathers no context and calls no recorder.
// - Thread-safe: one mutex. The recorder runs outside it (torch's takes the GIL, and a thread
//   holding the GIL may be waiting for the mutex: a tensor freed from Python); trackers run
//   under it and must not allocate through this allocator (PyTorch documents the same rule).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>

#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace spillway::torch_plugin {

class allocation_history {
 public:
  using action = c10::CachingDeviceAllocator::TraceEntry::Action;

  void configure(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder,
                 std::size_t max_entries, c10::CachingDeviceAllocator::RecordContext when,
                 bool clear, const std::vector<std::string>& skip_actions);
  bool enabled() const;
  // Recording or tracking at all: callers skip the work of an event (finding its device) when not.
  bool active() const noexcept { return active_.load(std::memory_order_relaxed); }
  void attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker);

  // One event (ALLOC, FREE_REQUESTED or OOM); `stream` is the raw stream, `address` the block's
  // (OOM: the device's free bytes, as PyTorch writes it). ALLOC keeps the allocation's context
  // (when one is gathered); FREE_REQUESTED hands it to the free.
  void record(action what, c10::DeviceIndex device, std::size_t address, std::size_t size, void* stream);
  // The block at `ptr` may be handed out again. Called under the device lock: gathers nothing.
  void record_free_completed(c10::DeviceIndex device, const void* ptr, std::size_t size, void* stream);

  std::vector<c10::CachingDeviceAllocator::TraceEntry> entries(c10::DeviceIndex device) const;
  std::shared_ptr<c10::GatheredContext> context_of(const void* ptr) const;

 private:
  void add_locked(action what, c10::DeviceIndex device, std::size_t address, std::size_t size,
                  void* stream, std::shared_ptr<c10::GatheredContext> context);

  mutable std::mutex mutex_;
  // Entries are stamped with the approximate (TSC) clock, as PyTorch's are; entries() gives them
  // in microseconds since the epoch, as PyTorch's snapshot() does (time_us).
  mutable c10::ApproximateClockToUnixTimeConverter clock_;
  std::atomic<bool> active_{false};  // enabled_ || !trackers_.empty()
  bool enabled_ = false;
  // Read without the mutex by record(), which calls the recorder outside it.
  std::atomic<c10::CachingDeviceAllocator::CreateContextFn> recorder_{nullptr};
  std::atomic<c10::CachingDeviceAllocator::RecordContext> when_{
      c10::CachingDeviceAllocator::RecordContext::NEVER};
  std::size_t max_entries_ = 0;
  std::vector<bool> skipped_;  // by action
  std::unordered_map<c10::DeviceIndex, std::deque<c10::CachingDeviceAllocator::TraceEntry>> rings_;
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> live_contexts_;
  // Between a free's request and its completion: the context its entries carry.
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> freeing_contexts_;
  std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers_;
};

}  // namespace spillway::torch_plugin
