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
// - The context of each live allocation (RecordContext STATE or more) is kept for the snapshot's
//   BlockInfo::context_when_allocated.
// - Thread-safe: one mutex. Trackers and the recorder run under it: they must not allocate through
//   this allocator (PyTorch documents the same rule for its own).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

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

  // One event; `stream` is the raw stream. ALLOC keeps the allocation's context (when one is
  // gathered), FREE_REQUESTED forgets it.
  void record(action what, c10::DeviceIndex device, const void* ptr, std::size_t size, void* stream);

  std::vector<c10::CachingDeviceAllocator::TraceEntry> entries(c10::DeviceIndex device) const;
  std::shared_ptr<c10::GatheredContext> context_of(const void* ptr) const;

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> active_{false};  // enabled_ || !trackers_.empty()
  bool enabled_ = false;
  c10::CachingDeviceAllocator::CreateContextFn recorder_ = nullptr;
  c10::CachingDeviceAllocator::RecordContext when_ = c10::CachingDeviceAllocator::RecordContext::NEVER;
  std::size_t max_entries_ = 0;
  std::vector<bool> skipped_;  // by action
  std::unordered_map<c10::DeviceIndex, std::deque<c10::CachingDeviceAllocator::TraceEntry>> rings_;
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> live_contexts_;
  std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers_;
};

}  // namespace spillway::torch_plugin
