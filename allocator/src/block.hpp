// block.hpp (internal): the block and segment records of the caching allocator.
//
// A segment is one contiguous range of device memory: a cudaMalloc'd region, or the mapped prefix
// of an expandable (VMM) address range. Its blocks tile it exactly, linked in address order through
// prev/next (Note [Block tiling] in docs/design.md). A block is in exactly one of four states:
//
//   free          in its pool's free tree (pool_hook linked), usable by allocations on its stream
//   allocated     handed to a caller, in the live table (live_hook linked)
//   pending_free  freed by the caller, waiting for events on streams recorded with record_stream
//   unmapped      expandable segments only: whole granules given back to the device, in its
//                 segment's hole tree (pool_hook linked), not in a free tree: only growth maps
//                 it again (Note [Expandable segments])
//
// Blocks and segments are allocated from object pools owned by the device allocator, so splitting
// and coalescing never call malloc.
#pragma once

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>
#include <boost/intrusive/unordered_set.hpp>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "spillway/device_backend.hpp"
#include "spillway/size_classes.hpp"

namespace spillway::detail {

namespace bi = boost::intrusive;

struct segment;

enum class block_status : std::uint8_t { free, allocated, pending_free, unmapped };

struct block {
  bi::set_member_hook<bi::link_mode<bi::normal_link>> pool_hook;            // free or hole tree
  bi::unordered_set_member_hook<bi::link_mode<bi::normal_link>> live_hook;  // live table

  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;   // what the caller asked for; 0 while free
  stream_ref stream;                // the stream it was allocated on (its pool key)
  segment* seg = nullptr;
  block* prev = nullptr;            // address-order neighbours within the segment
  block* next = nullptr;
  block_status status = block_status::free;
  std::uint32_t pending_events = 0; // events still to complete before a pending_free block is free
  std::vector<stream_ref> stream_uses;  // other streams recorded with record_stream

  bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
  void* ptr() const noexcept { return reinterpret_cast<void*>(address); }
};

// The unmapped blocks of an expandable segment, by address.
struct block_address_order {
  bool operator()(const block& a, const block& b) const noexcept { return a.address < b.address; }
};
using hole_tree =
    bi::set<block, bi::member_hook<block, decltype(block::pool_hook), &block::pool_hook>,
            bi::compare<block_address_order>, bi::constant_time_size<true>>;

struct segment {
  bi::list_member_hook<bi::link_mode<bi::normal_link>> list_hook;  // the device's segment list

  std::uintptr_t address = 0;
  std::size_t size = 0;             // bytes its blocks tile (expandable: holes included; the
                                    // address range after them is unmapped)
  std::size_t address_range = 0;    // expandable: bytes of address space reserved, else == size
  bool small = false;               // serves the small pool
  bool expandable = false;
  stream_ref stream;
  block* first = nullptr;           // lowest-address block; nullptr only for an empty expandable one
  block* tail = nullptr;            // highest-address block, kept in step by split/coalesce/grow;
                                    // never unmapped (an unmapped tail shrinks `size` instead)
  hole_tree holes;                  // expandable: its unmapped blocks
  // Its allocated blocks, their bytes, and its pending_free blocks, kept where a block changes
  // state (take_block_locked, deallocate, defer_free_locked, free_block_locked), so that
  // partly_free_segments reads each segment once instead of walking its blocks (Note [Compaction]).
  std::size_t live_blocks = 0;
  std::size_t allocated_bytes = 0;
  std::size_t pending_blocks = 0;

  block* last() const noexcept { return tail; }
  bool fully_free() const noexcept;
};

// --- the free tree: ordered by (stream, size, address), so lower_bound finds the best fit on a
// stream and ties go to the lowest address (which keeps the top of segments free for growth). ---
struct block_order {
  bool operator()(const block& a, const block& b) const noexcept {
    if (a.stream != b.stream) return a.stream < b.stream;
    if (a.size != b.size) return a.size < b.size;
    return a.address < b.address;
  }
};

struct fit_key {
  stream_ref stream;
  std::size_t size;
};

struct fit_key_order {
  bool operator()(const block& a, const fit_key& k) const noexcept {
    if (a.stream != k.stream) return a.stream < k.stream;
    return a.size < k.size;
  }
  bool operator()(const fit_key& k, const block& a) const noexcept {
    if (k.stream != a.stream) return k.stream < a.stream;
    return k.size < a.size;
  }
};

using free_tree =
    bi::set<block, bi::member_hook<block, decltype(block::pool_hook), &block::pool_hook>,
            bi::compare<block_order>, bi::constant_time_size<true>>;

// --- the live table: live blocks by address. Power-of-two buckets, grown by the owner. ---
struct block_address_equal {
  bool operator()(const block& a, const block& b) const noexcept { return a.address == b.address; }
  bool operator()(std::uintptr_t a, const block& b) const noexcept { return a == b.address; }
  bool operator()(const block& a, std::uintptr_t b) const noexcept { return a.address == b; }
};

struct block_address_hash {
  // Addresses are 512-byte aligned (often 2 MiB apart); multiply, then fold the high half in,
  // because power-of-two buckets use the low bits.
  std::size_t operator()(std::uintptr_t a) const noexcept {
    const std::uint64_t h = static_cast<std::uint64_t>(a >> 9) * 0x9E3779B97F4A7C15ull;
    return static_cast<std::size_t>(h ^ (h >> 32));
  }
  std::size_t operator()(const block& b) const noexcept { return (*this)(b.address); }
};

using live_table =
    bi::unordered_set<block, bi::member_hook<block, decltype(block::live_hook), &block::live_hook>,
                      bi::equal<block_address_equal>, bi::hash<block_address_hash>,
                      bi::power_2_buckets<true>, bi::constant_time_size<true>>;

using segment_list =
    bi::list<segment, bi::member_hook<segment, decltype(segment::list_hook), &segment::list_hook>,
             bi::constant_time_size<true>>;

// Calls f(first, end) for each maximal run of mapped blocks of seg, in address order: [first, end)
// in block order, end being the hole after the run or nullptr. A plain segment is one run.
template <class F>
void for_each_mapped_run(const segment& seg, F f) {
  for (const block* b = seg.first; b != nullptr;) {
    if (b->status == block_status::unmapped) {
      b = b->next;
      continue;
    }
    const block* first = b;
    while (b != nullptr && b->status != block_status::unmapped) b = b->next;
    f(first, b);
  }
}

// The whole granules inside [from, to): (first address, bytes); bytes is 0 when there are none.
inline std::pair<std::uintptr_t, std::size_t> whole_granules(std::uintptr_t from, std::uintptr_t to,
                                                             std::size_t granularity) noexcept {
  const std::uintptr_t lo = size_classes::round_up(from, granularity);
  const std::uintptr_t hi = to / granularity * granularity;
  return {lo, hi > lo ? hi - lo : 0};
}

inline bool segment::fully_free() const noexcept {
  return first != nullptr && first->next == nullptr && first->status == block_status::free;
}

}  // namespace spillway::detail
