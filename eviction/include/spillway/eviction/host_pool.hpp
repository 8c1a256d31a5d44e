// host_pool: a caching pool of pinned host memory for spilled buffers.
//
// Contract
// - allocate(bytes) returns pinned host memory of at least `bytes`, reusing a cached block when
//   one fits (best fit, at most 25% larger than the rounded request) and asking the backend
//   (allocate_pinned_host, i.e. cudaHostAlloc) only on a miss. No cudaHostAlloc per spill.
// - It returns nullptr, never throws, when the pool is at its capacity or the backend has no
//   pinned memory: the engine then drops (where lineage exists) or picks another victim.
//   On a backend failure it first releases its cached blocks and, if it had any, tries once more.
// - free_after(ptr, event) returns a block to the cache once `event` has completed (the copy
//   that reads it); free(ptr) returns it at once. Unknown pointers (never handed out, already
//   freed, interior, null) are spillway::invalid_argument naming the pointer; nothing changes
//   then, and free_after leaves `event` with the caller. allocate, free, free_after,
//   release_cached and room first reap the blocks whose event has completed (event_completed,
//   then destroy_event); the const calls do not.
// - The destructor waits for pending events and gives every block back to the backend, also
//   those still handed out. A block whose event cannot be waited for (the wait throws) is leaked
//   rather than freed under a copy that may still use it.
// - Rounding: 4 KiB multiples up to 2 MiB, then 2 MiB multiples (0 bytes gets a 4 KiB block).
// - Capacity: a miss that would go over it first gives cached blocks back (largest first); if the
//   blocks in use leave no room, it fails.
// - Thread-safe (one mutex). The backend must outlive the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "spillway/device_backend.hpp"

namespace spillway::eviction {

struct host_pool_stats {
  std::size_t held_bytes = 0;        // pinned bytes obtained from the backend and not released
  std::size_t in_use_bytes = 0;      // handed out (including those waiting on an event)
  std::size_t peak_held_bytes = 0;
  std::uint64_t backend_allocations = 0;
  std::uint64_t cache_hits = 0;
  std::uint64_t failed_allocations = 0;
};

class host_pool {
 public:
  // capacity: the most pinned bytes the pool holds from the backend (cached + in use).
  host_pool(device_backend& backend, std::size_t capacity);
  ~host_pool();
  host_pool(const host_pool&) = delete;
  host_pool& operator=(const host_pool&) = delete;

  void* allocate(std::size_t bytes) noexcept;
  void free(void* ptr);
  void free_after(void* ptr, event_ref event);   // the pool takes ownership of `event`
  std::size_t block_size(const void* ptr) const;  // the rounded size; invalid_argument if unknown
  std::size_t release_cached() noexcept;          // gives cached blocks back to the backend
  // The pinned bytes allocate may still hand out within the capacity (cached blocks count as room:
  // they are given back for a miss), once the blocks whose event has completed are reaped: a
  // caller that asks before allocating (the engine, deciding whether it may spill) would
  // otherwise see blocks long free as in use, and never allocate, which is what reaps them.
  std::size_t room() noexcept;
  host_pool_stats stats() const;
  static std::size_t round_size(std::size_t bytes) noexcept;

 private:
  void reap_locked() noexcept;
  void* allocate_locked(std::size_t rounded) noexcept;
  void* allocate_from_backend_locked(std::size_t rounded) noexcept;
  std::size_t release_cached_locked(std::size_t wanted) noexcept;  // largest first
  std::size_t handed_out_size_locked(const void* ptr, const char* call) const;  // or throws

  device_backend& backend_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> cached_;             // size -> block
  std::unordered_map<const void*, std::size_t> sizes_;   // every block the pool holds
  std::vector<std::pair<event_ref, void*>> pending_;     // freed after an event
  std::unordered_set<const void*> handed_out_;           // allocated, not yet freed
  host_pool_stats stats_;
};

}  // namespace spillway::eviction
