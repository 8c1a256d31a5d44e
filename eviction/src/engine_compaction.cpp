// engine_compaction.cpp: emptying fixed segments by moving buffers into other segments' holes.
//
// Note [Compaction] (docs/eviction.md), in short: under a budget with fixed segments, an
// allocation fails when no segment has a contiguous range for it and a new segment would pass the
// budget, even though the segments hold enough free bytes between them. Evicting frees bytes at
// the price of a recompute or a round trip over the link; moving a buffer costs one copy at the
// device's memory bandwidth. So before choosing any victim, the pressure handler empties the
// segments that cost least to empty: every live block of such a segment must be an unpinned,
// resident, registered buffer, and each must find a hole in another segment that holds live
// blocks too. The emptied segments are then given back by the allocator, and the request is
// reserved in their place.
//
// Stream order: the copy runs on the buffer's stream, after the streams that used it; the old
// block is freed behind it, so its reuse on that stream is ordered after the copy, and on another
// stream it is not reused before those streams' events (Note [Cross-stream frees]). Segments with
// a buffer other streams used are emptied last (compact_for_locked).
#include <algorithm>

#include "engine_impl.hpp"

namespace spillway::eviction {

using detail::buffer_entry;

std::size_t eviction_engine::impl::compact_for_locked(const eviction_request& request,
                                                     pressure_result& result) {
  // Only a shortfall that giving back segments can cover: with expandable segments free granules
  // are unmapped instead, and the free bytes must at least cover what is missing.
  if (!config.compact || !request.contiguous || request.shortfall == 0 || candidates.size() == 0) {
    return 0;
  }
  if (allocator.cached_free_bytes() < request.shortfall) return 0;

  std::size_t emptied = 0;
  std::vector<void*> targets;  // taken for the segment being emptied, not yet handed to a buffer
  try {
    std::vector<segment_usage> segments = allocator.partly_free_segments();
    // The cheapest to empty first (least to copy); by address on ties, so runs repeat exactly.
    std::sort(segments.begin(), segments.end(), [](const segment_usage& a, const segment_usage& b) {
      if (a.allocated_bytes != b.allocated_bytes) return a.allocated_bytes < b.allocated_bytes;
      return a.base < b.base;
    });
    std::vector<buffer_entry*> movers;
    // Two passes: first the segments whose buffers only their own stream used; then, for what is
    // still short, those with a buffer another stream used too (its old block's free waits for
    // that stream's work, which the allocator may have to wait for before the segment is free:
    // a host wait, still cheaper than an eviction, but only as a last resort). A segment emptied
    // in the first pass has no live block left, so the second finds nothing to move in it.
    bool copy_failed = false;  // a move that could not be queued ends compaction
    for (int pass = 0; pass < 2 && emptied < request.shortfall && !copy_failed; ++pass) {
      for (const segment_usage& s : segments) {
        if (emptied >= request.shortfall) break;
        if (!movable_locked(s, /*other_streams=*/pass == 1, movers)) continue;
        const segment_move outcome = empty_segment_locked(s, movers, targets, result);
        if (outcome == segment_move::copy_failed) {
          copy_failed = true;
          break;
        }
        if (outcome == segment_move::emptied) {
          emptied += s.size;  // every live block of it moved: it is free as a whole
          ++stats.segments_emptied;
        }
      }
    }
  } catch (const std::exception&) {
    // Out of host memory for the lists or a block record: what is done stays done, the holes
    // taken for the segment under way go back, and eviction goes on from here.
    for (void* t : targets) allocator.deallocate(t);
  }
  return emptied;
}

// Moves `movers`, every live block of s, into holes of other segments: all or none. Every buffer
// needs a hole outside the segment before anything is copied, since a segment emptied in part
// gives nothing back. `targets` holds the holes taken and not yet handed over (the caller's, so
// that they go back should host memory run out).
eviction_engine::impl::segment_move eviction_engine::impl::empty_segment_locked(
    const segment_usage& s, std::vector<buffer_entry*>& movers, std::vector<void*>& targets,
    pressure_result& result) {
  // Largest first, the ones hardest to place.
  std::sort(movers.begin(), movers.end(), [](const buffer_entry* a, const buffer_entry* b) {
    return a->size != b->size ? a->size > b->size : a->device_ptr < b->device_ptr;
  });
  targets.reserve(movers.size());
  for (const buffer_entry* e : movers) {
    void* t = allocator.allocate_cached(e->size, e->stream, s.base);
    if (t == nullptr) break;
    targets.push_back(t);
  }
  if (targets.size() < movers.size()) {
    for (void* t : targets) allocator.deallocate(t);
    targets.clear();
    return segment_move::no_room;
  }
  // In order; a move that cannot be queued (a copy fault) leaves the segment in use: the holes
  // taken for the rest are given back, and the moves already made stay (harmless).
  std::size_t moved = 0;
  for (; moved < movers.size(); ++moved) {
    void* t = targets[moved];
    targets[moved] = nullptr;
    if (!move_locked(*movers[moved], t)) break;
    result.freed += movers[moved]->size;
  }
  for (void* t : targets) allocator.deallocate(t);  // nullptr: handed over, nothing to do
  targets.clear();
  return moved < movers.size() ? segment_move::copy_failed : segment_move::emptied;
}

// Whether every live block of s is a buffer the engine may move now (a candidate: resident,
// unpinned, evictable, and, unless other_streams, used on its own stream only); they go to `out`.
bool eviction_engine::impl::movable_locked(const segment_usage& s, bool other_streams,
                                           std::vector<buffer_entry*>& out) const {
  out.clear();
  // Stops at the first block that may not move (often the first: a parameter at the segment's
  // start). Under the allocator's lock: reads only the engine's own records.
  const bool all = allocator.for_each_live_allocation(s.base, [&](void* p) {
    const auto it = by_pointer.find(p);
    if (it == by_pointer.end()) return false;  // not the engine's: a parameter, an output...
    buffer_entry& e = *it->second;
    if (!candidates.contains(e) || e.ready.value != 0 || e.stream != s.stream) return false;
    if (!other_streams && !e.use_streams.empty()) return false;  // see compact_for_locked
    out.push_back(&e);
    return true;
  });
  return all && !out.empty();
}

// Moves resident, unpinned e into `target` (a live block of e's size on e's stream, taken for it);
// false, with e where it was and target given back, if the copy cannot be queued.
bool eviction_engine::impl::move_locked(buffer_entry& e, void* target) {
  try {
    for (stream_ref s : e.use_streams) order_after_locked(e.stream, s);  // their work on e first
    backend.copy_async(target, e.device_ptr, e.size, copy_kind::device_to_device, e.stream);
    by_pointer.emplace(target, &e);
  } catch (const std::exception&) {
    // Nothing queued reads target after this: a copy that was queued is drained first.
    try {
      backend.synchronize_stream(e.stream);
    } catch (...) {
    }
    allocator.deallocate(target);
    return false;
  }
  by_pointer.erase(e.device_ptr);
  allocator.deallocate(e.device_ptr);  // reused in stream order behind the copy
  e.device_ptr = target;
  e.use_streams.clear();
  note_block_locked(e);
  // Its record names the old block's segment. Updated in place: a move is not a use, so the
  // buffer keeps its place in the LRU order and in the cost order (its costs did not change).
  candidates.record(e) = make_record_locked(e);
  ++stats.moves;
  stats.bytes_moved += e.size;
  return true;
}

}  // namespace spillway::eviction
