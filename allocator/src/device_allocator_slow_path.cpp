// device_allocator_slow_path.cpp: the memory pressure path, reservation, release and budgets.
//
// Note [Memory pressure path] (docs/design.md) is the essay; in short, an allocation that misses
// the cache goes through these named steps, each tried only if the ones before found nothing:
//
//   1. reap_completed_events      cross-stream frees whose events completed become reusable
//   2. reserve                    a new segment (or more pages of the expandable one) within budget
//   3. pressure handlers          the eviction engine frees activations (lock released), and
//                                 frees that wait on copy events are awaited; segments the
//                                 evictions emptied are released before the next round
//   4. release_cached             frees pending on other streams are awaited; every free segment
//                                 goes back to the device, then reserve again
//   5. fail                       out_of_memory, with the numbers that explain it
//
// Releasing cached segments comes after eviction because it synchronises the device (like
// cudaFree), while eviction is stream-ordered and asynchronous.
#include <algorithm>
#include <exception>
#include <sstream>

#include "device_allocator_impl.hpp"

namespace spillway {

using detail::block;
using detail::block_pool;
using detail::block_status;
using detail::segment;

namespace {

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
}

block* device_allocator::impl::allocate_slow_releasing_lock(std::unique_lock<std::mutex>& lock,
                                                    block_pool& pool, stream_ref stream,
                                                    std::size_t rounded, std::size_t requested) {
  // Step 1: cross-stream frees whose events have completed.
  if (reap_completed_events_locked() > 0) {
    if (block* b = pool.best_fit(stream, rounded)) return b;
  }
  // Step 2: fresh memory within the budget.
  if (block* b = reserve_locked(pool, stream, rounded)) return b;

  ++stats.num_alloc_retries;
  // Step 3: pressure handlers, then frees that wait on events they scheduled. Rounds go on while
  // they free memory: evictions scattered over segments that other live blocks hold may take many
  // before a range fits, and the request fails only once nothing more can be evicted. A round
  // that claims bytes but frees no allocation ends them (a handler that cannot make progress).
  std::size_t pinned = 0;
  while (!handlers.empty()) {
    const std::int64_t live_before = stats.allocated_bytes[0].current;
    const pressure_result r =
        run_pressure_handlers_releasing_lock(lock, make_request_locked(pool, stream, rounded));
    pinned = r.pinned;
    reap_completed_events_locked();
    if (block* b = pool.best_fit(stream, rounded)) return b;
    if (block* b = reserve_locked(pool, stream, rounded)) return b;
    if (pending_count > 0 && await_pending_frees_locked()) {
      if (block* b = pool.best_fit(stream, rounded)) return b;
      if (block* b = reserve_locked(pool, stream, rounded)) return b;
    }
    // Evictions that emptied whole segments (of another pool or stream, or too small) serve this
    // request only once those are given back: do that before evicting more.
    if (r.freed > 0 && release_cached_locked() > 0) {
      if (block* b = reserve_locked(pool, stream, rounded)) return b;
    }
    if (r.freed == 0 || stats.allocated_bytes[0].current >= live_before) break;
  }
  // Step 4: wait for the frees still pending on other streams (the release below synchronises
  // the device anyway; without this, memory the caller has freed would be reported as missing),
  // then give every free segment back to the device and reserve again.
  if (pending_count > 0 && await_pending_frees_locked(/*all=*/true)) {
    if (block* b = pool.best_fit(stream, rounded)) return b;
  }
  if (release_cached_locked() > 0) {
    if (block* b = reserve_locked(pool, stream, rounded)) return b;
  }
  // Step 5: fail; nothing has changed for the caller.
  throw_out_of_memory_locked(requested, rounded, pinned);
}

// --- step 1: reap --------------------------------------------------------------------------------

std::size_t device_allocator::impl::reap_completed_events_locked() {
  if (pending_count == 0) return 0;
  std::size_t freed = 0;
  for (auto& [s, queue] : pending) {
    // Events on one stream complete in order: stop at the first that has not.
    while (!queue.empty() && backend->event_completed(queue.front().event)) {
      const pending_event pe = queue.front();
      queue.pop_front();
      --pending_count;
      idle_events.push_back(pe.event);
      if (--pe.blk->pending_events == 0) {
        free_block_locked(pe.blk);
        ++freed;
      }
    }
  }
  return freed;
}

// Waits (lock held) for the oldest pending event of each stream, or with `all` for the newest
// (events on a stream complete in order, so that is all of them). Only under pressure. False if
// nothing became free, or the backend cannot wait (a held sim stream).
bool device_allocator::impl::await_pending_frees_locked(bool all) {
  try {
    for (auto& [s, queue] : pending) {
      if (queue.empty()) continue;
      backend->synchronize_event(all ? queue.back().event : queue.front().event);
    }
  } catch (const std::exception&) {
    return false;
  }
  return reap_completed_events_locked() > 0;
}

// --- step 2: reserve -----------------------------------------------------------------------------

block* device_allocator::impl::reserve_locked(block_pool& pool, stream_ref stream,
                                              std::size_t rounded) {
  return granularity > 0 ? grow_expandable_locked(pool, stream, rounded)
                         : reserve_segment_locked(pool, stream, rounded);
}

void device_allocator::impl::count_segment_locked(const segment& seg, int sign,
                                                  std::size_t bytes) noexcept {
  const int t = seg.small ? static_cast<int>(stat_type::small_pool)
                          : static_cast<int>(stat_type::large_pool);
  for (int i : {0, t}) {
    if (sign > 0) {
      stats.reserved_bytes[i].increase(static_cast<std::int64_t>(bytes));
    } else {
      stats.reserved_bytes[i].decrease(static_cast<std::int64_t>(bytes));
    }
  }
  if (sign > 0) ++stats.num_device_alloc; else ++stats.num_device_free;
}

block* device_allocator::impl::reserve_segment_locked(block_pool& pool, stream_ref stream,
                                                      std::size_t rounded) {
  // The preferred size, or the smallest that serves the request when the budget is tight.
  std::size_t size = size_classes::segment_size(rounded);
  if (!fits_budget_locked(size)) size = size_classes::min_segment_size(rounded);
  if (!fits_budget_locked(size)) return nullptr;

  segment* seg = segment_records.make();
  block* b = block_records.make();
  void* base = nullptr;
  {
    undo_on_throw guard{[&] {
      if (base != nullptr) backend->release_segment(base, size);
      block_records.recycle(b);
      segment_records.recycle(seg);
    }};
    base = backend->reserve_segment(size);
    if (base == nullptr && size != size_classes::min_segment_size(rounded)) {
      size = size_classes::min_segment_size(rounded);  // the device is nearly full: ask for less
      base = backend->reserve_segment(size);
    }
    if (base == nullptr) {
      block_records.recycle(b);
      segment_records.recycle(seg);
      return nullptr;
    }
    seg->address = reinterpret_cast<std::uintptr_t>(base);
    segments_by_address.emplace(seg->address, seg);
  }
  seg->size = seg->address_range = size;
  seg->small = pool.small();
  seg->stream = stream;
  seg->first = seg->tail = b;
  b->address = seg->address;
  b->size = size;
  b->stream = stream;
  b->seg = seg;
  segments.push_back(*seg);
  for (int i : {0, pool.small() ? 1 : 2}) stats.segment[i].increase(1);
  count_segment_locked(*seg, +1, size);
  pool.insert(b);
  return b;
}

// Note [Expandable segments]: one address range per (pool, stream). Growth maps granules after
// the last block, extending it if it is free, unless a hole (granules unmapped by a release)
// that, with the free blocks beside it, spans the request needs no more of them. A new range is linked and
// counted only once its first pages are mapped: a growth that fails (budget, device) leaves no
// empty segment behind, so out_of_memory changes nothing.
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
  segment* created = seg == nullptr ? segment_records.make() : nullptr;
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
    for (int i : {0, pool.small() ? 1 : 2}) stats.segment[i].increase(1);
  }
  count_segment_locked(*seg, +1, grow);
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
  count_segment_locked(seg, +1, grow);
  // Mapped runs (what stats.segment counts). A hole always has a mapped block after it (the top
  // of a segment is never a hole), which its high granules join; its low granules join the run
  // before it, or start one at the segment's base; mapped whole, it joins the runs on both sides.
  const int runs = whole ? (hole->prev != nullptr ? -1 : 0)
                         : (from_top || hole->prev != nullptr ? 0 : 1);
  for (int i : {0, pool.small() ? 1 : 2}) {
    if (runs > 0) stats.segment[i].increase(runs);
    if (runs < 0) stats.segment[i].decrease(-runs);
  }
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

// --- step 3: pressure handlers ----------------------------------------------------------------------

pressure_request device_allocator::impl::make_request_locked(const block_pool& pool,
                                                             stream_ref stream,
                                                             std::size_t rounded) const {
  pressure_request r;
  r.device = device;
  r.stream = stream;
  r.bytes = rounded;
  r.small_pool = pool.small();
  r.budget = budget;
  r.reserved = reserved_locked();
  // The new memory the request needs: whole granules (expandable), or its smallest segment.
  r.contiguous = granularity == 0;
  const std::size_t need = r.reserved + (r.contiguous ? size_classes::min_segment_size(rounded)
                                                      : size_classes::round_up(rounded, granularity));
  r.shortfall = need > budget ? need - budget : 0;
  return r;
}

pressure_result device_allocator::impl::run_pressure_handlers_releasing_lock(
    std::unique_lock<std::mutex>& lock, const pressure_request& request) {
  auto snapshot = handlers;  // handlers may be added or removed while the lock is released
  ++stats.num_pressure_handler_calls;
  lock.unlock();
  pressure_result total;
  std::string failure;
  // Enough: the contiguous size wanted, or (a budget being lowered) the bytes over it.
  const std::size_t goal = request.bytes != 0 ? request.bytes : request.shortfall;
  for (auto& [id, handler] : snapshot) {
    try {
      const pressure_result r = (*handler)(request);
      total.freed += r.freed;
      total.pinned += r.pinned;
    } catch (const std::exception& e) {
      failure = e.what();
    } catch (...) {
      failure = "an exception that is not a std::exception";
    }
    if (goal != 0 && total.freed >= goal) break;
  }
  // Reported before the lock is taken again: the fewer user callbacks under the lock, the better.
  if (!failure.empty()) warn("spillway: a pressure handler failed and was skipped: " + failure);
  lock.lock();
  stats.pressure_handler_freed_bytes += static_cast<std::int64_t>(total.freed);
  return total;
}

// --- step 4: release -------------------------------------------------------------------------------

// Gives every free segment (and the free tail pages of expandable segments) back to the device.
// Returns the bytes released. See Note [Releasing memory to the device].
std::size_t device_allocator::impl::release_cached_locked() {
  // Frees pending on other streams are awaited first, as PyTorch's synchronize_and_free_events
  // does: the release synchronises the device anyway, and a block that becomes free may make its
  // segment free. A stream that cannot be waited for (a held sim stream) keeps its blocks pending.
  if (pending_count > 0) await_pending_frees_locked(/*all=*/true);
  // Synchronise only if something will be released: a whole free segment, an empty expandable
  // range, or a free block of an expandable one holding at least one whole granule.
  const auto releasable = [this](const segment& s) {
    if (!s.expandable) return s.fully_free();
    if (s.first == nullptr) return true;
    for (const block* b = s.first; b != nullptr; b = b->next) {
      if (b->status == block_status::free && free_granules(b).second > 0) return true;
    }
    return false;
  };
  if (std::none_of(segments.begin(), segments.end(), releasable)) return 0;
  try {
    backend->synchronize_device();  // queued work may still touch free blocks of their own stream
    ++stats.num_sync_all_streams;
  } catch (const std::exception& e) {
    warn(std::string("spillway: cached memory kept: the device could not be synchronised (") +
         e.what() + ")");
    return 0;
  }
  std::size_t released = 0;
  for (auto it = segments.begin(); it != segments.end();) {
    segment* seg = &*it++;
    if (seg->expandable) {
      released += unmap_free_pages_locked(seg);
    } else if (seg->fully_free()) {
      released += seg->size;
      release_segment_locked(seg);
    }
  }
  return released;
}

void device_allocator::impl::release_segment_locked(segment* seg) noexcept {
  if (seg->first != nullptr) {
    pool_of(seg->first).erase(seg->first);
    block_records.recycle(seg->first);
  }
  if (seg->expandable) {  // nothing is mapped; unmap_free_pages_locked counted its runs
    backend->release_address_range(reinterpret_cast<void*>(seg->address), seg->address_range);
  } else {
    backend->release_segment(reinterpret_cast<void*>(seg->address), seg->size);
    count_segment_locked(*seg, -1, seg->size);
    for (int i : {0, seg->small ? 1 : 2}) stats.segment[i].decrease(1);
  }
  segments.erase(segments.iterator_to(*seg));
  segments_by_address.erase(seg->address);
  segment_records.recycle(seg);
}

// The whole granules inside a block: (first address, bytes); bytes is 0 when there are none.
std::pair<std::uintptr_t, std::size_t> device_allocator::impl::free_granules(
    const block* b) const noexcept {
  const std::uintptr_t lo = size_classes::round_up(b->address, granularity);
  const std::uintptr_t hi = (b->address + b->size) / granularity * granularity;
  return {lo, hi > lo ? hi - lo : 0};
}

namespace {
// What stats.segment counts for an expandable segment: its maximal runs of mapped blocks (one
// per segment in snapshot()).
std::int64_t mapped_runs(const segment& seg) noexcept {
  std::int64_t runs = 0;
  for (const block* b = seg.first; b != nullptr; b = b->next) {
    if (b->status != block_status::unmapped &&
        (b->prev == nullptr || b->prev->status == block_status::unmapped)) {
      ++runs;
    }
  }
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
  const std::int64_t runs = mapped_runs(*seg) - runs_before;
  for (int i : {0, seg->small ? 1 : 2}) {
    if (runs > 0) stats.segment[i].increase(runs);
    if (runs < 0) stats.segment[i].decrease(-runs);
  }
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
  backend->unmap_physical(reinterpret_cast<void*>(lo), bytes);
  count_segment_locked(seg, -1, bytes);
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

// --- budgets -----------------------------------------------------------------------------------------

budget_report device_allocator::impl::set_budget_releasing_lock(std::unique_lock<std::mutex>& lock,
                                                        std::size_t bytes, bool strict) {
  if (bytes == 0) {
    throw invalid_argument("spillway: set_budget(0) on device " + std::to_string(device) +
                           ": a budget must be at least 1 byte (unlimited_budget for none)");
  }
  budget_report report;
  const auto refuse = [&] {
    std::ostringstream m;
    m << "spillway: set_budget(" << format_bytes(bytes) << ") on device " << device
      << ": the budget is below the " << format_bytes(allocated_locked())
      << " held by live allocations" << (handlers.empty() ? "" : " that could not be evicted")
      << "; the budget stays "
      << (budget == unlimited_budget ? std::string("unlimited") : format_bytes(budget));
    if (report.released > 0) m << " (" << format_bytes(report.released) << " of cache was released)";
    throw invalid_argument(m.str());
  };
  // Without handlers nothing can evict: refuse before touching anything.
  if (strict && handlers.empty() && allocated_locked() > bytes) refuse();
  if (reserved_locked() > bytes) {
    // Over the new budget: trim the cache, ask the handlers, trim again.
    reap_completed_events_locked();
    report.released += release_cached_locked();
    if (reserved_locked() > bytes && !handlers.empty()) {
      pressure_request r = make_request_locked(large_pool, stream_ref{}, 0);
      r.bytes = 0;
      r.budget = bytes;
      r.shortfall = reserved_locked() - bytes;
      run_pressure_handlers_releasing_lock(lock, r);
      reap_completed_events_locked();
      if (pending_count > 0) await_pending_frees_locked();
      report.released += release_cached_locked();
    }
    // Handlers evicted what they could; evicted data is not lost (spilled or recomputable).
    if (strict && allocated_locked() > bytes) refuse();
  }
  budget = bytes;
  stats.budget = bytes == unlimited_budget ? -1 : static_cast<std::int64_t>(bytes);
  report.budget = bytes;
  report.reserved = reserved_locked();
  report.shortfall = report.reserved > bytes ? report.reserved - bytes : 0;
  return report;
}

// --- step 5: fail ----------------------------------------------------------------------------------

void device_allocator::impl::throw_out_of_memory_locked(std::size_t requested, std::size_t rounded,
                                                        std::size_t pinned) {
  ++stats.num_ooms;
  out_of_memory::details d;
  d.device = device;
  d.requested = requested;
  d.rounded = rounded;
  d.budget = budget;
  d.allocated = allocated_locked();
  d.reserved = reserved_locked();
  d.largest_free = largest_free_locked();
  try {
    d.device_free = backend->free_memory();
  } catch (const std::exception&) {
    d.device_free = 0;
  }
  d.pinned = pinned;
  std::ostringstream m;
  m << "spillway: out of memory on device " << device << " (" << backend->name()
    << "): tried to allocate " << format_bytes(requested) << " (" << requested << " bytes, "
    << format_bytes(rounded) << " rounded); budget "
    << (budget == unlimited_budget ? std::string("unlimited") : format_bytes(budget)) << ", "
    << format_bytes(d.allocated) << " allocated, " << format_bytes(d.reserved)
    << " reserved, largest free block " << format_bytes(d.largest_free) << ", "
    << format_bytes(d.device_free) << " free on the device";
  if (pinned > 0) m << "; " << format_bytes(pinned) << " are pinned and could not be evicted";
  throw out_of_memory(m.str(), d);
}

}  // namespace spillway
