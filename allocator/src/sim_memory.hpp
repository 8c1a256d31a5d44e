// sim_memory: the memory of the simulated device: plain segments, VMM address ranges and their
// pages, and pinned host memory.
//
// Contract
// - Everything handed out is real host memory from mmap (MAP_PRIVATE | MAP_ANONYMOUS |
//   MAP_NORESERVE): untouched bytes cost nothing, written bytes read back. mmap alignment (a page)
//   covers the 512-byte alignment cudaMalloc promises.
// - Device capacity counts segment bytes and mapped pages (counters.used_bytes); address ranges
//   are free, like virtual address space on a GPU. Pinned host memory has its own capacity.
//   "No memory" (over capacity, or mmap/mprotect refused) is nullptr / false, never an exception.
// - Plain segments are carved from one address arena reserved at the first segment (twice the
//   capacity, at most 1 TiB), lowest address first, so where a segment lands depends only on the
//   sequence of reservations and releases, never on where the kernel puts an mmap (ASLR). The
//   allocator breaks best-fit ties by address, so this is what makes a replay repeatable run to
//   run. A segment that does not fit in the arena (its address space fragmented) gets an mmap of
//   its own. Releasing a segment maps PROT_NONE over it: its bytes go back and a stale pointer
//   faults.
// - VMM: an address range is PROT_NONE and aligned to the granularity. map() makes pages
//   read/write and counts them; unmap() drops their contents (MADV_DONTNEED: a page mapped again
//   reads as zeros) and makes them PROT_NONE again, so a stale pointer faults as on a GPU.
// - check_map() throws invalid_argument (naming the address) for every misuse of map(): VMM off,
//   a range not inside one reservation, misalignment, a page that is already mapped. release_* /
//   unmap() are noexcept and ignore what they do not know.
// - Not thread-safe: sim_device calls it under its mutex. The destructor unmaps everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "spillway/sim_device.hpp"

namespace spillway::detail {

class sim_memory {
 public:
  // `name` ("sim:0") prefixes error messages.
  sim_memory(const sim_config& config, sim_counters& counters, std::string name);
  ~sim_memory();

  sim_memory(const sim_memory&) = delete;
  sim_memory& operator=(const sim_memory&) = delete;

  void* reserve_segment(std::size_t bytes) noexcept;  // nullptr: over capacity or no mmap
  bool release_segment(void* ptr) noexcept;  // false (ignored, counted) for an unknown pointer

  void* reserve_address_range(std::size_t bytes);  // invalid_argument: VMM off or size unaligned
  bool release_address_range(void* base) noexcept;  // also uncounts pages still mapped in it
  void check_map(const void* addr, std::size_t bytes) const;
  bool map(void* addr, std::size_t bytes) noexcept;  // after check_map(); false: no memory
  std::size_t unmap(void* addr, std::size_t bytes) noexcept;  // pages unmapped

  void* allocate_pinned(std::size_t bytes) noexcept;  // nullptr: over capacity or no mmap
  bool free_pinned(void* ptr) noexcept;

 private:
  struct address_range {
    std::size_t bytes = 0;
    std::vector<bool> mapped;  // one flag per granularity page
  };

  // The reservation that holds [addr, addr + bytes) entirely, or nullptr.
  const address_range* find_range(std::uintptr_t addr, std::size_t bytes,
                                   std::uintptr_t* base) const noexcept;
  address_range* find_range(std::uintptr_t addr, std::size_t bytes, std::uintptr_t* base) noexcept;
  void unmap_pages(std::uintptr_t base, address_range& range, std::size_t first,
                   std::size_t last) noexcept;
  void* carve_from_arena(std::size_t bytes) noexcept;     // nullptr: no arena or no room
  bool return_to_arena(void* ptr, std::size_t bytes) noexcept;  // false: not from the arena
  bool in_arena(const void* ptr) const noexcept;
  void count_device(std::size_t bytes) noexcept;
  void uncount_device(std::size_t bytes) noexcept;
  [[noreturn]] void throw_bad_map(const void* addr, std::size_t bytes, const std::string& why) const;

  const sim_config& config_;
  sim_counters& counters_;
  std::string name_;
  std::unordered_map<void*, std::size_t> segments_;
  // The segment arena: [arena_base_, arena_base_ + arena_bytes_), its free ranges by offset.
  std::uintptr_t arena_base_ = 0;
  std::size_t arena_bytes_ = 0;
  bool arena_tried_ = false;
  std::map<std::size_t, std::size_t> arena_free_;  // offset -> bytes, no two adjacent
  std::map<std::uintptr_t, address_range> ranges_;  // by base address
  std::unordered_map<void*, std::size_t> pinned_;
};

}  // namespace spillway::detail
