// pressure: the hook through which the eviction engine (or anyone) frees memory when an
// allocation does not fit the budget.
//
// Contract
// - A handler is called by the allocator's pressure path (Note [Memory pressure path]) WITHOUT the
//   device lock held, from the thread whose allocation is under pressure. It frees memory by calling
//   deallocate on the same allocator (directly, or by stream-ordered frees that complete later).
// - It should free a contiguous range of at least `request.bytes` in the request's pool and stream
//   when it can (device_allocator::coalesced_size_if_freed tells what releasing a block would
//   coalesce into); freeing scattered bytes may not help.
// - It returns what it freed and what it could not touch (pinned). freed == 0 means "I can do no
//   more for this request"; the allocator then moves on to the next step.
// - Handlers may be called concurrently from different threads; they must be thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "spillway/device_backend.hpp"

namespace spillway {

struct pressure_request {
  int device = 0;
  stream_ref stream;          // the stream of the allocation under pressure
  std::size_t bytes = 0;      // the contiguous, rounded size needed (0: set_budget is trimming)
  bool small_pool = false;    // which pool the request is served from
  std::size_t budget = 0;     // the budget in force (set_budget: the budget asked for)
  std::size_t reserved = 0;   // reserved bytes when the handler was called
  // How far reserved + the smallest new segment that serves the request
  // (size_classes::min_segment_size(bytes)) exceeds the budget, 0 if within budget; for
  // set_budget, reserved - the budget asked for.
  std::size_t shortfall = 0;
  // False with expandable segments: `bytes` free in one range of the request's stream and pool
  // serve it in place, and so do whole free granules anywhere that cover `shortfall` (they are
  // unmapped and mapped again where the request goes; Note [Expandable segments]); bytes freed
  // in granules that live blocks still share give nothing back
  // (device_allocator::releasable_if_freed tells). True with fixed segments: `bytes` must be
  // free in one range of a segment of the request's stream and pool, or whole segments must be
  // given back.
  bool contiguous = true;
};

struct pressure_result {
  std::size_t freed = 0;      // bytes the handler deallocated (or scheduled for deallocation),
                              // blocks it moved elsewhere included (Note [Compaction])
  std::size_t pinned = 0;     // bytes it holds that could not be evicted right now
};

using pressure_handler = std::function<pressure_result(const pressure_request&)>;
using pressure_handler_id = std::uint64_t;

}  // namespace spillway
