// stats: allocator statistics, field for field what torch.cuda.memory_stats() reports.
//
// Each stat has current / peak / allocated (cumulative increments) / freed (cumulative decrements),
// kept for three pool types: aggregate, small pool and large pool, exactly like PyTorch's
// c10::CachingDeviceAllocator::DeviceStats. The PyTorch plugin copies these fields one to one.
//
//   allocation / allocated_bytes       live allocations handed to callers
//   segment / reserved_bytes           memory held from the device
//   active / active_bytes              allocated blocks, including those waiting on stream events
//   inactive_split / _bytes            free blocks that are a split piece of a segment
//   requested_bytes                    what callers asked for, before rounding
//
// One difference in timing: a block whose free waits on other streams' events stays active
// (active, active_bytes, requested_bytes) until an allocation that misses the cache, empty_cache
// or a budget change looks at its events (Note [Cross-stream frees]); PyTorch looks at them at
// every allocation. The fast path never queries events.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace spillway {

struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t n) noexcept {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t n) noexcept {
    current -= n;
    freed += n;
  }
  void reset_accumulated() noexcept { allocated = freed = 0; }
  void reset_peak() noexcept { peak = current; }
};

enum class stat_type : int { aggregate = 0, small_pool = 1, large_pool = 2 };
inline constexpr int stat_type_count = 3;

using stat_array = std::array<stat, stat_type_count>;

struct memory_stats {
  stat_array allocation;
  stat_array segment;
  stat_array active;
  stat_array inactive_split;

  stat_array allocated_bytes;
  stat_array reserved_bytes;
  stat_array active_bytes;
  stat_array inactive_split_bytes;
  stat_array requested_bytes;

  std::int64_t num_alloc_retries = 0;   // allocations that needed the pressure path past reuse
  std::int64_t num_ooms = 0;            // out_of_memory thrown
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;    // segments reserved / pages mapped
  std::int64_t num_device_free = 0;     // segments released / pages unmapped
  std::int64_t num_invalid_frees = 0;   // deallocate calls with a pointer that is not live

  stat oversize_allocations;             // live blocks of at least max_split_size (Note [Oversize blocks])
  stat oversize_segments;
  std::int64_t max_split_size = -1;      // allocator_config::max_split_size; -1: no limit

  // The memory budget (reserved-bytes cap) and what the pressure path freed through handlers.
  std::int64_t budget = 0;
  std::int64_t num_pressure_handler_calls = 0;
  std::int64_t pressure_handler_freed_bytes = 0;
  // Allocations over the budget served by giving free cached memory back, with no handler call
  // (step 3 of Note [Memory pressure path]): counted when the reservation that followed succeeded.
  std::int64_t num_releases_before_eviction = 0;
  // Small requests served by a free block of the large pool once nothing else could serve them
  // (step 6 of Note [Memory pressure path]).
  std::int64_t num_small_from_large = 0;
};

}  // namespace spillway
