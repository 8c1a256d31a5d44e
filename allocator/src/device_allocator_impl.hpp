// device_allocator_impl.hpp (internal): the state of one device's allocator and the named steps
// that operate on it. Methods ending in _locked assume the device mutex is held; a method that
// releases the lock says so in its name (_releasing_lock).
//
// Files:
//   device_allocator.cpp                the public methods and the fast paths (allocate, free)
//   device_allocator_slow_path.cpp      the memory pressure path, reservation, release, budgets
//   device_allocator_expandable.cpp     expandable segments: growth, holes, unmapping
//   device_allocator_introspection.cpp  statistics, snapshot, describe, warnings
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "block.hpp"
#include "block_pool.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

namespace spillway {

namespace detail {
// Runs `undo` when a reservation step leaves by an exception (a device_error from the backend),
// so that records and address ranges taken so far are given back.
template <class F>
struct undo_on_throw {
  F undo;
  int exceptions = std::uncaught_exceptions();
  ~undo_on_throw() {
    if (std::uncaught_exceptions() > exceptions) undo();
  }
};
template <class F>
undo_on_throw(F) -> undo_on_throw<F>;
}  // namespace detail

struct device_allocator::impl {
  impl(std::shared_ptr<device_backend> backend, allocator_config config);

  // --- state (guarded by mutex) ---------------------------------------------------------------
  std::shared_ptr<device_backend> backend;
  allocator_config config;
  int device = 0;
  mutable std::mutex mutex;
  memory_stats stats;
  detail::block_pool small_pool{true, stats};
  detail::block_pool large_pool{false, stats};
  detail::live_blocks live;
  detail::record_arena<detail::block> block_records;
  detail::record_arena<detail::segment> segment_records;
  detail::segment_list segments;                                 // every segment
  std::map<std::uintptr_t, detail::segment*> segments_by_address;  // slow paths only
  std::size_t budget = unlimited_budget;
  std::size_t granularity = 0;  // > 0: expandable segments are in use

  // Cross-stream frees waiting on events (Note [Cross-stream frees]), FIFO per stream.
  struct pending_event {
    event_ref event;
    detail::block* blk;
  };
  std::vector<std::pair<stream_ref, std::deque<pending_event>>> pending;
  std::size_t pending_count = 0;
  std::vector<event_ref> idle_events;

  std::vector<std::pair<pressure_handler_id, std::shared_ptr<const pressure_handler>>> handlers;
  pressure_handler_id next_handler_id = 1;
  // Caller frees so far; never reset (unlike stats). The pressure path's measure of progress:
  // other threads allocate while the handlers run, so live bytes alone cannot show an eviction.
  std::uint64_t num_frees = 0;

  // --- fast path helpers (device_allocator.cpp) -------------------------------------------------
  detail::block_pool& pool_for(std::size_t rounded) noexcept {
    return size_classes::is_small(rounded) ? small_pool : large_pool;
  }
  detail::block_pool& pool_of(const detail::block* b) noexcept {
    return b->seg->small ? small_pool : large_pool;
  }
  // Whether b, serving `rounded`, is split. PyTorch keeps a large-pool remainder of up to 1 MiB
  // in the block (no slivers in the large pool); in an expandable segment (every segment, when
  // granularity > 0) a remainder joins the next growth or is unmapped with its free neighbours,
  // so any remainder is split off there.
  // An oversize block (Note [Oversize blocks]) is never split.
  bool splits_locked(const detail::block& b, std::size_t rounded) const noexcept {
    return granularity != 0 ? b.size - rounded >= size_classes::min_block_size
                            : size_classes::should_split(b.size, rounded) &&
                                  b.size < large_pool.max_split_size();
  }
  void take_block_locked(detail::block_pool& pool, detail::block* b, std::size_t rounded,
                         std::size_t requested);
  void set_max_split_size_locked();
  void free_block_locked(detail::block* b) noexcept;
  void insert_free_locked(detail::block* b) noexcept;
  // True when b went back to its pool at once (no event could be recorded: the streams were
  // waited for instead).
  bool defer_free_locked(detail::block* b) noexcept;
  std::size_t reserved_locked() const noexcept {
    return static_cast<std::size_t>(stats.reserved_bytes[0].current);
  }
  std::size_t allocated_locked() const noexcept {
    return static_cast<std::size_t>(stats.allocated_bytes[0].current);
  }

  // --- the memory pressure path (device_allocator_slow_path.cpp) --------------------------------
  detail::block* allocate_slow_releasing_lock(std::unique_lock<std::mutex>& lock, detail::block_pool& pool,
                                      stream_ref stream, std::size_t rounded, std::size_t requested);
  std::size_t reap_completed_events_locked();
  bool await_pending_frees_locked(bool all = false);
  detail::block* reserve_locked(detail::block_pool& pool, stream_ref stream, std::size_t rounded);
  detail::block* reserve_segment_locked(detail::block_pool& pool, stream_ref stream,
                                        std::size_t rounded);
  detail::block* grow_expandable_locked(detail::block_pool& pool, stream_ref stream,
                                        std::size_t rounded);
  pressure_result run_pressure_handlers_releasing_lock(std::unique_lock<std::mutex>& lock,
                                                       const pressure_request& request);
  pressure_request make_request_locked(const detail::block_pool& pool, stream_ref stream,
                                       std::size_t rounded) const;
  std::size_t budget_shortfall_locked(std::size_t rounded) const noexcept;
  // The least a reservation for `rounded` takes: a segment of the smallest size that serves it,
  // or (expandable) the granules that hold it.
  std::size_t least_reservation(std::size_t rounded) const noexcept {
    return granularity == 0 ? size_classes::min_segment_size(rounded)
                            : size_classes::round_up(rounded, granularity);
  }
  std::size_t releasable_locked(const detail::segment& s) const noexcept;
  std::size_t releasable_bytes_locked() const noexcept;
  static constexpr std::size_t all_cached = ~std::size_t{0};
  std::size_t release_cached_locked(std::size_t enough = all_cached);
  void release_segment_locked(detail::segment* seg) noexcept;
  detail::block* map_hole_locked(detail::block_pool& pool, stream_ref stream, std::size_t rounded,
                                 std::size_t limit);
  std::size_t unmap_free_pages_locked(detail::segment* seg) noexcept;
  std::size_t unmap_block_locked(detail::block*& b) noexcept;
  // detail::whole_granules (block.hpp) at this allocator's granularity.
  std::pair<std::uintptr_t, std::size_t> whole_granules(std::uintptr_t from,
                                                        std::uintptr_t to) const noexcept;
  // The whole granules inside a block (whole_granules of its range).
  std::pair<std::uintptr_t, std::size_t> free_granules(const detail::block* b) const noexcept;
  budget_report set_budget_releasing_lock(std::unique_lock<std::mutex>& lock, std::size_t bytes,
                                  bool strict);
  bool fits_budget_locked(std::size_t more) const noexcept {
    return more <= budget && reserved_locked() <= budget - more;
  }
  [[noreturn]] void throw_out_of_memory_locked(std::size_t requested, std::size_t rounded,
                                               std::size_t pinned);

  // --- introspection and reporting (device_allocator_introspection.cpp) --------------------------
  std::size_t largest_free_locked() const noexcept;
  free_status classify_invalid_free_locked(std::uintptr_t address, std::string& message) const noexcept;
  void warn(const std::string& message) const noexcept;
  detail::segment* segment_containing_locked(std::uintptr_t address) const noexcept;
  // Device memory came (sign +1) or goes (-1) under seg at [address, address + bytes): counts it
  // and tells config.on_segment_change (before the memory goes).
  void segment_changed_locked(const detail::segment& seg, int sign, std::uintptr_t address,
                              std::size_t bytes) noexcept;
  // stats.segment (aggregate and the pool's) moved by `delta` segments, or mapped runs.
  void count_segments_locked(bool small, std::int64_t delta) noexcept {
    for (int i : {0, small ? 1 : 2}) {
      if (delta > 0) stats.segment[i].increase(delta);
      if (delta < 0) stats.segment[i].decrease(-delta);
    }
  }
};

}  // namespace spillway
