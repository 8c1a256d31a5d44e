// device_allocator: a stream-ordered caching allocator for one device, within a memory budget.
//
// Contract
// - allocate(bytes, stream) returns a 512-byte aligned pointer, usable in stream order on `stream`.
//   It throws invalid_argument for bytes == 0 or bytes > size_classes::max_request_size, and
//   out_of_memory when the request cannot fit within the budget and the device after the whole
//   pressure path: reuse -> reap finished events -> reserve -> release the free cache when that
//   alone covers the budget's shortfall -> pressure handlers -> release cached segments -> a
//   small request from a large free block -> fail
//   (Note [Memory pressure path]). After out_of_memory no live allocation has
//   changed (cached memory may have been released, and pressure handlers may have evicted).
// - deallocate(ptr) is noexcept. A block returns to its pool at once when only its own stream used
//   it; when record_stream added other streams, it returns once an event recorded on each of them
//   has completed (Note [Cross-stream frees]). There is no device-wide synchronisation.
//   A pointer that is not a live allocation is reported through config.on_warning, counted in
//   memory_stats::num_invalid_frees, and changes nothing; the status says which case it was.
// - The budget caps reserved (physical) bytes. Lowering it releases cached memory first, then asks
//   the pressure handlers; a budget below the bytes in live allocations that cannot be evicted is
//   refused with invalid_argument and leaves the old budget in force (without handlers the refusal
//   comes before anything is released), or, with below_live::accept, is set all the same: new
//   segments then fail until frees bring reserved memory under it (the report's shortfall).
//   A set_budget that refuses a budget below live memory (below_live::refuse) and throws (the
//   refusal, host out of memory, a device error) leaves the old budget in force; one that accepts
//   it (below_live::accept, as scoped_budget's restore does) sets it however it ends. The cache
//   released on the way stays released.
// - Backend calls (event queries, synchronisation) are made with the device lock held: work they
//   run (a simulated kernel's effect) and config.on_warning must not call back into the allocator.
// - Every public method takes the device lock (one std::mutex); pressure handlers run without it.
//
// The allocation fast path (a cache hit) is: lock, round, one tree lookup, one hash insert,
// statistics, unlock. Everything else lives in the slow path (device_allocator_slow_path.cpp).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "spillway/allocator_config.hpp"
#include "spillway/device_backend.hpp"
#include "spillway/pressure.hpp"
#include "spillway/snapshot.hpp"
#include "spillway/stats.hpp"

namespace spillway {

enum class free_status {
  freed,             // returned to its pool now
  deferred,          // waits on events of other streams
  unknown_pointer,   // not in any segment of this allocator
  not_live,          // inside a segment but not a live allocation: already freed, or not a block start
  null_pointer,      // nullptr: nothing to free (like cudaFree(nullptr)); neither counted nor reported
};

// What set_budget does with a budget below the bytes that live allocations hold after eviction.
enum class below_live {
  refuse,  // invalid_argument naming both; the old budget stays
  accept,  // set it: allocations that need a new segment fail until enough is freed (torch's
           // set_per_process_memory_fraction behaves so)
};

struct budget_report {
  std::size_t budget = 0;     // the budget now in force
  std::size_t reserved = 0;   // reserved bytes after trimming
  std::size_t released = 0;   // cached bytes released to the device to meet it
  std::size_t shortfall = 0;  // reserved - budget when it could not be met (memory in use)
  bool met() const noexcept { return shortfall == 0; }
};

// Where a live allocation sits: its segment's base and size (PyTorch's getBaseAllocation).
struct allocation_info {
  void* ptr = nullptr;
  std::size_t size = 0;            // rounded block size
  std::size_t requested_size = 0;
  stream_ref stream;
  void* segment_base = nullptr;
  std::size_t segment_size = 0;
};

// A fixed segment that holds live and free blocks: what emptying it by moving its live blocks
// elsewhere would cost (allocated_bytes copied) and give back (size). See Note [Compaction].
struct segment_usage {
  void* base = nullptr;
  std::size_t size = 0;
  std::size_t allocated_bytes = 0;  // in its live blocks
  std::size_t live_blocks = 0;
  bool small = false;               // serves the small pool
  stream_ref stream;
};

class device_allocator {
 public:
  explicit device_allocator(std::shared_ptr<device_backend> backend, allocator_config config = {});
  ~device_allocator();  // releases every segment; live allocations are reported via on_warning

  device_allocator(const device_allocator&) = delete;
  device_allocator& operator=(const device_allocator&) = delete;

  void* allocate(std::size_t bytes, stream_ref stream = {});
  free_status deallocate(void* ptr) noexcept;

  // Marks `ptr` as used by `stream`, so that its memory is not reused before work already queued
  // on `stream` completes. Throws invalid_argument for a pointer that is not live.
  void record_stream(void* ptr, stream_ref stream);

  bool owns(const void* ptr) const noexcept;  // ptr is a live allocation of this allocator
  // ptr lies in memory this allocator holds from the device (a segment or an expandable address
  // range), live or not. Edges that route frees between spillway and another allocator (the
  // preload shim) use it so that a stale pointer into spillway's memory never reaches the other.
  bool holds(const void* ptr) const noexcept;
  allocation_info describe(const void* ptr) const;  // throws invalid_argument if not live

  // The size of the free range that deallocating `ptr` would coalesce into once every pending free
  // has completed: its own block plus the run of free and pending-free neighbours around it in its
  // segment. 0 if ptr is not live. For fragmentation-aware eviction.
  std::size_t coalesced_size_if_freed(const void* ptr) const noexcept;
  // The bytes that deallocating `ptr` would add to what a release can give back to the device,
  // counting pending frees as free as above: its segment's size if that leaves the segment
  // empty (fixed segments), or the whole granules of that coalesced range that are not already
  // whole granules of its free neighbours (expandable segments: a block that shares its granules
  // with live blocks adds none). 0 if ptr is not live. For eviction under a budget.
  std::size_t releasable_if_freed(const void* ptr) const noexcept;
  // Whether allocate(bytes, stream) would be served now without the pressure path: by a cached
  // free block on `stream`, or by memory reserved within the budget that the device has free. A
  // hint, not a promise (another thread may take the room first); what
  // speculative work, such as a prefetch, asks so as not to make the allocator evict for it.
  bool fits_without_eviction(std::size_t bytes, stream_ref stream = {}) const noexcept;

  // Compaction, for a caller that owns live allocations and may move them (the eviction engine;
  // Note [Compaction] in docs/eviction.md). Fixed segments only: with expandable segments free
  // granules are unmapped instead, and partly_free_segments returns nothing.
  // - partly_free_segments: every fixed segment with both live blocks and free ones, and no block
  //   whose free waits on events (such a segment could not be given back at once).
  // - for_each_live_allocation: calls f(ptr) for the live allocations of the segment based at
  //   `segment_base`, in address order, until f returns false; returns false if f did or there
  //   is no such segment. f runs under the device lock and must not call the allocator.
  // - allocate_cached: an allocation served from a cached free block of a segment that holds
  //   live blocks (a hole: never a segment with none, such as one compaction just emptied),
  //   outside the segment holding `outside` (nullptr: anywhere), by the fast path's best fit and
  //   rules; nullptr when none fits. It never reserves memory, nor calls pressure handlers, so
  //   it may be called from one. Throws invalid_argument for bytes the fast path rejects, and
  //   std::bad_alloc when the host has no memory for a block record.
  // - cached_free_bytes: reserved bytes not in live allocations (what compaction could give back
  //   at most). O(1).
  std::vector<segment_usage> partly_free_segments() const;
  bool for_each_live_allocation(const void* segment_base, const std::function<bool(void*)>& f) const;
  void* allocate_cached(std::size_t bytes, stream_ref stream, const void* outside);
  std::size_t cached_free_bytes() const noexcept;

  budget_report set_budget(std::size_t bytes, below_live when_below = below_live::refuse);
  std::size_t budget() const noexcept;

  std::size_t empty_cache();  // releases every free segment and the free tails of expandable ones
  // What a release would give back to the device now: every free segment, and the whole free
  // granules of expandable segments; frees still waiting on events are not counted. O(1).
  std::size_t releasable_bytes() const noexcept;
  memory_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  memory_snapshot snapshot() const;
  std::size_t largest_free_block() const;

  pressure_handler_id add_pressure_handler(pressure_handler handler);
  void remove_pressure_handler(pressure_handler_id id) noexcept;

  int device() const noexcept;
  device_backend& backend() const noexcept;
  const allocator_config& config() const noexcept;

 private:
  friend class scoped_budget;
  struct impl;
  std::unique_ptr<impl> impl_;
};

// Sets a budget for the lifetime of the scope and restores the previous one on exit.
// Construction throws what set_budget throws; the destructor never throws (a restore that cannot be
// met in full is reported through the allocator's on_warning). Scopes of one device nest: each
// restores what was in force when it began, so they must end in the reverse order they began
// (on one thread, as blocks do). Scopes of several threads on one device that overlap without
// nesting restore each other's budgets out of order: the budget is the device's, not a thread's.
class scoped_budget {
 public:
  scoped_budget(device_allocator& allocator, std::size_t bytes);
  ~scoped_budget();
  scoped_budget(const scoped_budget&) = delete;
  scoped_budget& operator=(const scoped_budget&) = delete;

  const budget_report& report() const noexcept { return report_; }

 private:
  device_allocator& allocator_;
  std::size_t previous_;
  budget_report report_;
};

}  // namespace spillway
