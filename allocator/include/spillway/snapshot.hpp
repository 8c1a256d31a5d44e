// snapshot: the segments and blocks of a device, field for field PyTorch's memory snapshot
// (c10::cuda::CUDACachingAllocator::SegmentInfo / BlockInfo, and the dicts that
// torch.cuda.memory._snapshot() returns).
//
//   segment_info.address/total_size/requested_size/allocated_size/active_size/stream/is_large/
//   is_expandable                                 -> SegmentInfo fields of the same names
//   block_info.size/requested_size/allocated/active -> BlockInfo fields
//   block_info.address                              -> the block's "address" in _snapshot()
//
// Blocks of a segment are listed in address order and tile the segment exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "spillway/device_backend.hpp"

namespace spillway {

enum class block_state {
  inactive,               // free, in the cache
  active_allocated,       // handed to a caller
  active_pending_free,    // freed by the caller, waiting on events of other streams
};

struct block_info {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;  // 0 when inactive
  block_state state = block_state::inactive;

  bool allocated() const noexcept { return state == block_state::active_allocated; }
  bool active() const noexcept { return state != block_state::inactive; }
};

struct segment_info {
  int device = 0;
  std::uintptr_t address = 0;
  std::size_t total_size = 0;      // mapped bytes (for an expandable segment: what is mapped now)
  std::size_t requested_size = 0;
  std::size_t allocated_size = 0;
  std::size_t active_size = 0;
  stream_ref stream;
  bool is_large = false;
  bool is_expandable = false;
  std::vector<block_info> blocks;
};

struct memory_snapshot {
  std::vector<segment_info> segments;
};

}  // namespace spillway
