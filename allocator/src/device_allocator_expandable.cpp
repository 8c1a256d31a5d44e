// device_allocator_expandable.cpp: expandable (VMM) segments: growth, holes and their release.
//
// Note [Expandable segments] (docs/design.md) is the essay. An expandable segment is one address
// range per (pool, stream) whose blocks tile it from its base to its last mapped block; a block
// is free, allocated, pending or unmapped (a hole, in the segment's hole tree). Growth maps
// granules at the top or, when that needs no fewer, a hole; a release turns the whole granules of
// free blocks into holes. stats.segment counts runs of mapped blocks, as snapshot() lists them.
#include <algorithm>

#include "device_allocator_impl.hpp"

namespace spillway {

using detail::block;
using detail::block_pool;
using detail::block_status;
using detail::segment;
using detail::undo_on_throw;

// Note [Expandable segments]: one address range per (pool, stream). Growth maps granules after
// the last block, extending it if it is free, unless a hole (granules unmapped by a release)
// that, with the free blocks beside it, spans the request needs no more of them. A new range is
// linked and counted only once its first pages are mapped: a growth that fails (budget, device)
// leaves no empty segment behind, so out_of_memory changes nothing.
block* device_allocator::impl::grow_expandable_locked(block_pool& pool, stream_ref stream,
                                                      std::size_t rounded) {
  // The top: the (pool, stream) segment whose address range still has room for this growth; a
  // new range when every one is used up (normally there is one per (pool, stream)).
  segment* seg = nullptr;
  block* tail = nullptr;
  std::size_t have = 0;
  std::size_t grow = size_classes::round_up(rounded, granularity);
  for (segment& s : segments) {
    if (!s.expandable || s.small != pool.small() || s.stream != stream) continue;
    block* t = s.last();
    const std::size_t free_tail = (t != nullptr && t->status == block_status::free) ? t->size : 0;
    if (free_tail >= rounded) return t;  // freed since the caller's best_fit (a reaped event)
    const std::size_t needed = size_classes::round_up(rounded - free_tail, granularity);
    if (needed <= s.address_range - s.size) {
      seg = &s;
      tail = t;
      have = free_tail;
      grow = needed;
      break;
    }
  }
  // A hole that needs no more granules than the top (then the top stays where it is).
  if (block* b = map_hole_locked(pool, stream, rounded, grow)) return b;
  if (!fits_budget_locked(grow)) return nullptr;

  std::size_t range = 0;
  if (seg == nullptr) {
    range = config.expandable_address_range != 0 ? config.expandable_address_range
                                                 : backend->total_memory();
    range = size_classes::round_up(std::max(range, rounded), granularity);
  }
  // Records first: they are the steps that can throw, and nothing has happened yet.
  block* fresh = have > 0 ? nullptr : block_records.make();
  segment* created = nullptr;
  if (seg == nullptr) {
    try {
      created = segment_records.make();
    } catch (...) {
      if (fresh != nullptr) block_records.recycle(fresh);
      throw;
    }
  }
  void* base = nullptr;     // a newly reserved range
  bool mapped = false;
  const auto give_back = [&] {  // on nullptr and on a device_error alike
    if (mapped) backend->unmap_physical(reinterpret_cast<void*>(seg->address + seg->size), grow);
    if (base != nullptr) backend->release_address_range(base, range);
    if (fresh != nullptr) block_records.recycle(fresh);
    if (created != nullptr) segment_records.recycle(created);
  };
  undo_on_throw guard{give_back};
  if (created != nullptr) {
    base = backend->reserve_address_range(range);
    if (base == nullptr) {
      give_back();
      return nullptr;
    }
    created->address = reinterpret_cast<std::uintptr_t>(base);
    created->address_range = range;
    created->small = pool.small();
    created->expandable = true;
    created->stream = stream;
    seg = created;
  }
  mapped = backend->map_physical(reinterpret_cast<void*>(seg->address + seg->size), grow);
  if (!mapped) {
    give_back();
    return nullptr;
  }
  if (created != nullptr) {  // mapped: now it is a segment of this allocator
    segments_by_address.emplace(seg->address, seg);
    segments.push_back(*seg);
    count_segments_locked(pool.small(), 1);
  }
  segment_changed_locked(*seg, +1, seg->address + seg->size, grow);
  if (fresh == nullptr) {  // the free tail grows in place
    pool.erase(tail);
    tail->size += grow;
    pool.insert(tail);
    seg->size += grow;
    return tail;
  }
  fresh->address = seg->address + seg->size;
  fresh->size = grow;
  fresh->stream = stream;
  fresh->seg = seg;
  fresh->prev = tail;
  if (tail != nullptr) tail->next = fresh; else seg->first = fresh;
  seg->tail = fresh;
  seg->size += grow;
  pool.insert(fresh);
  return fresh;
}

namespace {
std::size_t free_size(const block* b) noexcept {
  return b != nullptr && b->status == block_status::free ? b->size : 0;
}
}  // namespace

// The hole of a (pool, stream) expandable segment that serves `rounded` with the fewest new
// granules, at most `limit` (the lowest address on ties), is mapped as far as the request needs,
// from whichever end needs fewer (its low end with the free block before it, or its high end with
// the free block after it), and merged with the free blocks beside it. nullptr: no such hole, or
// its granules exceed the budget.
block* device_allocator::impl::map_hole_locked(block_pool& pool, stream_ref stream,
                                               std::size_t rounded, std::size_t limit) {
  block* hole = nullptr;
  std::size_t grow = 0;
  bool from_top = false;
  const auto granules_beyond = [this, rounded](std::size_t have) {
    return size_classes::round_up(rounded - std::min(rounded, have), granularity);
  };
  for (segment& s : segments) {
    if (!s.expandable || s.holes.empty() || s.small != pool.small() || s.stream != stream) continue;
    for (block& h : s.holes) {
      const std::size_t before = free_size(h.prev);
      const std::size_t after = free_size(h.next);
      if (before >= rounded || after >= rounded || before + h.size + after < rounded) continue;
      const std::size_t low = granules_beyond(before);   // [h, ...) after the free block before
      const std::size_t high = granules_beyond(after);   // [..., h's end) before the free one after
      const std::size_t need = std::min({h.size, low, high});
      if (need <= limit && (hole == nullptr || need < grow)) {
        hole = &h;
        grow = need;
        from_top = high < low;
      }
    }
  }
  if (hole == nullptr || !fits_budget_locked(grow)) return nullptr;

  segment& seg = *hole->seg;
  const bool whole = grow == hole->size;
  const std::uintptr_t at = whole || !from_top ? hole->address : hole->address + hole->size - grow;
  block* mapped = whole ? hole : block_records.make();  // may throw: nothing has changed yet
  bool ok = false;
  {
    undo_on_throw guard{[&] {
      if (mapped != hole) block_records.recycle(mapped);
    }};
    ok = backend->map_physical(reinterpret_cast<void*>(at), grow);
  }
  if (!ok) {
    if (mapped != hole) block_records.recycle(mapped);
    return nullptr;
  }
  segment_changed_locked(seg, +1, at, grow);
  // Mapped runs (what stats.segment counts). A hole always has a mapped block after it (the top
  // of a segment is never a hole), which its high granules join; its low granules join the run
  // before it, or start one at the segment's base; mapped whole, it joins the runs on both sides.
  const int runs = whole ? (hole->prev != nullptr ? -1 : 0)
                         : (from_top || hole->prev != nullptr ? 0 : 1);
  count_segments_locked(pool.small(), runs);
  if (whole) {
    seg.holes.erase(seg.holes.iterator_to(*hole));
  } else {  // the hole keeps the rest; its place in the tree holds either way
    mapped->address = at;
    mapped->size = grow;
    mapped->stream = hole->stream;
    mapped->seg = &seg;
    if (from_top) {
      mapped->prev = hole;
      mapped->next = hole->next;
      hole->next->prev = mapped;
      hole->next = mapped;
    } else {
      mapped->prev = hole->prev;
      mapped->next = hole;
      if (hole->prev != nullptr) hole->prev->next = mapped; else seg.first = mapped;
      hole->prev = mapped;
      hole->address += grow;
    }
    hole->size -= grow;
  }
  insert_free_locked(mapped);  // merges with the free blocks beside it
  return mapped;
}

// --- release ----------------------------------------------------------------------------------------

std::pair<std::uintptr_t, std::size_t> device_allocator::impl::whole_granules(
    std::uintptr_t from, std::uintptr_t to) const noexcept {
  return detail::whole_granules(from, to, granularity);
}

std::pair<std::uintptr_t, std::size_t> device_allocator::impl::free_granules(
    const block* b) const noexcept {
  return whole_granules(b->address, b->address + b->size);
}

namespace {
// What stats.segment counts for an expandable segment: its maximal runs of mapped blocks (one
// per segment in snapshot()).
std::int64_t mapped_runs(const segment& seg) noexcept {
  std::int64_t runs = 0;
  detail::for_each_mapped_run(seg, [&runs](const block*, const block*) { ++runs; });
  return runs;
}
}  // namespace

// Unmaps the whole granules of every free block of an expandable segment: each becomes a hole
// (merged with holes beside it), leaving the partial granules at its ends as smaller free blocks.
// A hole at the top is cut off the segment; a segment with nothing mapped gives its address range
// back. Returns the bytes unmapped. See Note [Expandable segments].
std::size_t device_allocator::impl::unmap_free_pages_locked(segment* seg) noexcept {
  const std::int64_t runs_before = mapped_runs(*seg);
  std::size_t released = 0;
  for (block* b = seg->first; b != nullptr; b = b->next) {
    if (b->status == block_status::free) released += unmap_block_locked(b);  // b: its last piece
  }
  if (block* top = seg->tail; top != nullptr && top->status == block_status::unmapped) {
    seg->holes.erase(seg->holes.iterator_to(*top));
    seg->size = top->address - seg->address;
    seg->tail = top->prev;
    if (top->prev != nullptr) top->prev->next = nullptr; else seg->first = nullptr;
    block_records.recycle(top);
  }
  count_segments_locked(seg->small, mapped_runs(*seg) - runs_before);
  if (seg->first == nullptr) release_segment_locked(seg);
  return released;
}

// Unmaps the whole granules inside free block b; the partial granules before and after them stay
// mapped, as free blocks of their own. Returns the bytes unmapped (0 when b holds no whole granule
// or no record could be made for a piece: then nothing changed) and leaves b at the highest of the
// blocks it became (records of merged holes are recycled).
std::size_t device_allocator::impl::unmap_block_locked(block*& b) noexcept {
  const auto [lo, bytes] = free_granules(b);
  if (bytes == 0) return 0;
  const std::uintptr_t end = b->address + b->size;
  block* hole = nullptr;
  block* after = nullptr;
  try {
    hole = lo > b->address ? block_records.make() : b;
    after = lo + bytes < end ? block_records.make() : nullptr;
  } catch (...) {
    if (hole != nullptr && hole != b) block_records.recycle(hole);
    return 0;
  }
  segment& seg = *b->seg;
  block_pool& pool = pool_of(b);
  pool.erase(b);
  segment_changed_locked(seg, -1, lo, bytes);
  backend->unmap_physical(reinterpret_cast<void*>(lo), bytes);
  // Pieces, in address order: [b: free, the partial granule below] hole [after: free, above].
  const auto link_after = [&seg](block* left, block* piece) {
    piece->stream = left->stream;
    piece->seg = left->seg;
    piece->prev = left;
    piece->next = left->next;
    if (left->next != nullptr) left->next->prev = piece; else seg.tail = piece;
    left->next = piece;
  };
  if (hole != b) {
    link_after(b, hole);
    b->size = lo - b->address;
    pool.insert(b);
  }
  hole->address = lo;
  hole->size = bytes;
  hole->status = block_status::unmapped;
  if (after != nullptr) {
    link_after(hole, after);
    after->address = lo + bytes;
    after->size = end - after->address;
    after->status = block_status::free;
    pool.insert(after);
  }
  // Holes beside it (possible only where no partial granule separates them) absorb it.
  if (block* p = hole->prev; p != nullptr && p->status == block_status::unmapped) {
    p->size += hole->size;
    p->next = hole->next;
    if (hole->next != nullptr) hole->next->prev = p; else seg.tail = p;
    block_records.recycle(hole);
    hole = p;
  } else {
    seg.holes.insert(*hole);
  }
  if (block* n = hole->next; n != nullptr && n->status == block_status::unmapped) {
    seg.holes.erase(seg.holes.iterator_to(*n));
    hole->size += n->size;
    hole->next = n->next;
    if (n->next != nullptr) n->next->prev = hole; else seg.tail = hole;
    block_records.recycle(n);
  }
  b = after != nullptr ? after : hole;
  return bytes;
}

}  // namespace spillway
