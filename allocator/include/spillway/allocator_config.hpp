// allocator_config: everything a device_allocator is told at construction.
//
// The core reads no environment variables and keeps no global state: SPILLWAY_CONF-style strings
// are parsed at the edges (tools, the torch plugin, the preload shim) into this struct.
#pragma once

#include <cstddef>
#include <functional>
#include <limits>
#include <string>

#include "spillway/device_backend.hpp"

namespace spillway {

inline constexpr std::size_t unlimited_budget = std::numeric_limits<std::size_t>::max();
inline constexpr std::size_t no_split_limit = std::numeric_limits<std::size_t>::max();

// What happened to device memory under a segment (allocator_config::on_segment_change), in
// PyTorch's trace terms: a fixed segment was reserved (SEGMENT_ALLOC) or released (SEGMENT_FREE),
// or a range of an expandable segment was mapped (SEGMENT_MAP) or unmapped (SEGMENT_UNMAP).
enum class segment_change { allocated, freed, mapped, unmapped };

struct allocator_config {
  // Cap on reserved (physical) bytes on the device. unlimited_budget: the device's capacity only.
  std::size_t budget = unlimited_budget;

  // Grow one segment per (stream, pool) in place with the backend's VMM instead of reserving new
  // segments (Note [Expandable segments] in docs/design.md). Ignored, with a warning through
  // on_warning, when the backend has no VMM.
  bool expandable_segments = false;

  // Address space reserved for each expandable segment. 0: the device's total memory. When one
  // range is used up, a (pool, stream) gets another. At most size_classes::max_request_size
  // (256 TiB): more is invalid_argument at construction.
  std::size_t expandable_address_range = 0;

  // PyTorch's max_split_size_mb, in bytes: free blocks of at least this size are "oversize". An
  // oversize block is never split; a request below the limit is served only from one less than
  // 2 MiB (the segment rounding) larger, and a request at or above it only from one less than
  // 20 MiB larger, so large cached segments stay
  // whole for the large requests they were made for instead of holding a small block at one end
  // (Note [Oversize blocks] in docs/design.md). no_split_limit: no limit (PyTorch's default).
  // Otherwise it must be over 20 MiB, the large pool's segment size. Fixed segments only: with
  // expandable segments any remainder is split off and unmapped, and the limit is ignored with a
  // warning through on_warning.
  std::size_t max_split_size = no_split_limit;

  // Receives the message for problems that cannot be thrown: a deallocate of a pointer that is not
  // live, a destructor finding live allocations, an option that was ignored. Default: stderr.
  // It may be called with the device lock held: it must not call back into the allocator.
  std::function<void(const std::string&)> on_warning;

  // Told when a deallocated block returns to its pool and may be handed out again: from
  // deallocate at once, or, for a block other streams used, once their events have completed
  // (Note [Cross-stream frees]), whichever call reaps them. It gets the pointer, the size the
  // allocation asked for and its stream. For allocation traces (torch's FREE_COMPLETED): called
  // with the device lock held, before any other thread can be given the memory, so a trace
  // never shows the memory's next allocation first. Like on_warning it must not call back into
  // the allocator; what it throws is dropped. Default: none.
  std::function<void(void* ptr, std::size_t requested_size, stream_ref stream)> on_free_completed;

  // Told when device memory comes or goes under a segment: a fixed segment's whole range at its
  // reservation and release; an expandable segment's range each time part of it is mapped or
  // unmapped; `stream` is the segment's. For torch's SEGMENT_* trace entries (NCCL registers
  // segments with these). Called with the device lock held, after the memory is mapped and
  // before it is released or unmapped; not at the allocator's destruction. Like
  // on_free_completed it must not call back into the allocator; what it throws is dropped.
  // Default: none.
  std::function<void(segment_change what, void* address, std::size_t bytes, stream_ref stream)>
      on_segment_change;
};

}  // namespace spillway
