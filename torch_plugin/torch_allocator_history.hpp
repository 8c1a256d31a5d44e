// torch_allocator_history: torch.cuda.memory._record_memory_history() for torch_allocator, and the
// allocator trace trackers torch attaches.
//
// Contract
// - While enabled, every allocation, free request, completed free, out-of-memory and segment
//   event (SEGMENT_ALLOC / SEGMENT_FREE for fixed segments, SEGMENT_MAP / SEGMENT_UNMAP for
//   ranges of expandable ones, from the device allocator's on_segment_change) that passes through
//   torch_allocator, and each snapshot taken (SNAPSHOT, size the active bytes listed), is kept as a c10 TraceEntry in a ring of at most max_entries per device
//   (oldest dropped first), with the context torch's recorder gathers (Python and C++ stacks)
//   when `when` asks for one. Actions named in skip_actions are not kept.
// - A call's context is gathered once, before the device lock, by a context_scope; the segment
//   events the call causes on its thread carry it, as in PyTorch's allocator. A fixed segment's
//   SEGMENT_FREE without one carries its SEGMENT_ALLOC's (segment_context gives that to the
//   snapshot); other segment events without one carry none.
// - Every attached tracker sees every entry, enabled or not, as PyTorch's allocator does.
// - As in PyTorch's allocator: each entry carries its device's compile context (the top of the
//   stack that push/pop_compile_context keep while history is enabled; "N/A" when empty) and its
//   user metadata (set_user_metadata, kept whether or not history is enabled); annotations
//   (record_annotation, while enabled) go to a ring of at most max_entries for every device,
//   emptied by each configure(), and come back from annotations().
// - Contexts follow PyTorch's allocator: an allocation's (RecordContext STATE or more) is kept for
//   the snapshot's BlockInfo::context_when_allocated; a free's entries carry the context gathered
//   at the free (ALL) or else the allocation's; entries carry contexts only with ALLOC or more.
// - FREE_COMPLETED comes from the device allocator's on_free_completed, when the block may be
//   handed out again (at once, or after the events of the other streams that used it), and the
//   segment events from its on_segment_change, both with the device lock held:
//   record_free_completed and record_segment gather no context and call no recorder.
// - Trackers are told each event after it is kept, outside the history's mutex (one for every
//   device), in the caller's thread: for FREE_COMPLETED and segment events, under that device's
//   lock, as PyTorch's allocator tells them.
// - Thread-safe: one mutex. The recorder runs outside it (torch's takes the GIL, and a thread
//   holding the GIL may be waiting for the mutex: a tensor freed from Python); so do trackers,
//   which must not allocate through this allocator (PyTorch documents the same rule).
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
#include <utility>
#include <vector>

#include "spillway/allocator_config.hpp"

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

  // The context an event of kind `what` carries under the current setting (ALLOC and OOM: with
  // STATE or more; FREE_REQUESTED: with ALL), or null. Calls the recorder: no lock may be held.
  std::shared_ptr<c10::GatheredContext> gather(action what) const;

  // One event (ALLOC, FREE_REQUESTED, OOM or SNAPSHOT); `stream` is the raw stream, `address` the block's
  // (OOM: the device's free bytes, as PyTorch writes it), `context` what gather() gave. ALLOC
  // keeps the allocation's context; FREE_REQUESTED hands it to the free.
  void record(action what, c10::DeviceIndex device, std::size_t address, std::size_t size,
              void* stream, std::shared_ptr<c10::GatheredContext> context);
  void record(action what, c10::DeviceIndex device, std::size_t address, std::size_t size,
              void* stream) {
    if (active()) record(what, device, address, size, stream, gather(what));
  }
  // The block at `ptr` may be handed out again. Called under the device lock: gathers nothing.
  void record_free_completed(c10::DeviceIndex device, const void* ptr, std::size_t size, void* stream);
  // Device memory came or went under a segment. Called under the device lock: gathers nothing;
  // carries the context of this thread's context_scope, if one is open.
  void record_segment(segment_change what, c10::DeviceIndex device, const void* address,
                      std::size_t size, void* stream);

  // For one call that may reserve or release segments (an allocation, empty_cache, a budget):
  // gathers the context an event of kind `what` carries (ALLOC: with STATE or more; a release,
  // FREE_REQUESTED: with ALL) before the device lock is taken, and until close() or its end lends
  // it to the segment events of this thread, as PyTorch's allocator passes its call's context.
  class context_scope {
   public:
    context_scope(const allocation_history& history, action what);
    ~context_scope() { close(); }
    context_scope(const context_scope&) = delete;
    context_scope& operator=(const context_scope&) = delete;
    const std::shared_ptr<c10::GatheredContext>& context() const noexcept { return context_; }
    void close() noexcept;  // segment events after it carry none of this scope's context

   private:
    friend class allocation_history;
    const allocation_history* history_;
    std::shared_ptr<c10::GatheredContext> context_;
    context_scope* outer_;  // the scope open before this one on this thread
    bool open_ = true;
  };

  void push_compile_context(c10::DeviceIndex device, std::string context);
  void pop_compile_context(c10::DeviceIndex device);
  void set_user_metadata(c10::DeviceIndex device, std::string metadata);
  std::string user_metadata(c10::DeviceIndex device) const;
  void record_annotation(c10::DeviceIndex device,
                         const std::vector<std::pair<std::string, std::string>>& metadata);

  std::vector<c10::CachingDeviceAllocator::TraceEntry> entries(c10::DeviceIndex device) const;
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations() const;
  std::shared_ptr<c10::GatheredContext> context_of(const void* ptr) const;
  // The context of the fixed segment at `address` (its SEGMENT_ALLOC's), while it is reserved.
  std::shared_ptr<c10::GatheredContext> segment_context(const void* address) const;

 private:
  void add_releasing_lock(std::unique_lock<std::mutex>& lock, action what, c10::DeviceIndex device,
                          std::size_t address, std::size_t size, void* stream,
                          std::shared_ptr<c10::GatheredContext> context);

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
  std::deque<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;  // every device's
  std::unordered_map<c10::DeviceIndex, std::vector<std::string>> compile_contexts_;  // stacks
  std::unordered_map<c10::DeviceIndex, std::string> user_metadata_;
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> live_contexts_;
  // Between a free's request and its completion: the context its entries carry.
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> freeing_contexts_;
  // Fixed segments' contexts, from SEGMENT_ALLOC to SEGMENT_FREE.
  std::unordered_map<const void*, std::shared_ptr<c10::GatheredContext>> segment_contexts_;
  using tracker_list = std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker>;
  std::shared_ptr<const tracker_list> trackers_;  // null until one is attached
};

}  // namespace spillway::torch_plugin
