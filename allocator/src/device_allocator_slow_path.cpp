// device_allocator_slow_path.cpp: the memory pressure path, reservation, release and budgets.
//
// Note [Memory pressure path] (docs/design.md) is the essay; in short, an allocation that misses
// the cache goes through these named steps, each tried only if the ones before found nothing:
//
//   1. reap_completed_events      cross-stream frees whose events completed become reusable
//   2. reserve                    a new segment (or more pages of the expandable one) within budget
//   3. release what covers it     if the cache's free segments (or free granules) cover the
//                                 budget shortfall, give back those that cover it (frees
//                                 pending on other streams awaited first) and reserve: no
//                                 eviction
//   4. pressure handlers          the eviction engine frees activations (lock released), and
//                                 frees that wait on copy events are awaited; segments the
//                                 evictions emptied are released before the next round
//   5. release_cached             frees pending on other streams are awaited; every free segment
//                                 goes back to the device, then reserve again
//   6. small from large           a small request takes a free block of the large pool
//   7. fail                       out_of_memory, with the numbers that explain it
//
// A release synchronises the device (like cudaFree) and eviction does not, but an eviction costs
// a recompute or a copy later; step 3 releases only when that alone serves the request. The
// Note says when each way is taken.
#include <algorithm>
#include <iterator>
#include <sstream>
#include <utility>
#include <vector>

#include "device_allocator_impl.hpp"

namespace spillway {

using detail::block;
using detail::block_pool;
using detail::block_status;
using detail::segment;
using detail::undo_on_throw;

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
  // Step 3: the cache holds what the budget lacks. Giving it back costs one device
  // synchronisation; evicting instead would cost a recompute or a copy per victim, and the round
  // would usually end in the same release (below), since the free segments are still there.
  if (const std::size_t shortfall = budget_shortfall_locked(rounded);
      shortfall > 0 && releasable_bytes_locked() >= shortfall) {
    // The release awaits the frees pending on other streams first: one may serve it in place,
    // or (expandable segments) join the free tail, so that growing it needs fewer granules.
    if (pending_count > 0 && await_pending_frees_locked(/*all=*/true)) {
      if (block* b = pool.best_fit(stream, rounded)) return b;
      if (block* b = reserve_locked(pool, stream, rounded)) return b;
    }
    if (release_cached_locked(shortfall) > 0) {
      if (block* b = reserve_locked(pool, stream, rounded)) {
        ++stats.num_releases_before_eviction;
        return b;
      }
    }
  }
  // Step 4: pressure handlers, then frees that wait on events they scheduled. Rounds go on while
  // they free memory: evictions scattered over segments that other live blocks hold may take many
  // before a range fits, and the request fails only once nothing more can be evicted. A round
  // that claims bytes but frees no allocation ends them (a handler that cannot make progress).
  // Progress is counted in frees, not live bytes: another thread may have taken what a round
  // freed while the lock was released, and the next round must still run. A round whose frees
  // are moves (the engine's compaction frees a block for each buffer it moves, and allocates
  // another) frees no bytes, but empties a segment, released below: reserved bytes go down at
  // every such round, so the rounds still end.
  std::size_t pinned = 0;
  while (!handlers.empty()) {
    const std::uint64_t frees_before = num_frees;
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
    if (r.freed == 0 || num_frees == frees_before) break;
  }
  // Step 5: wait for the frees still pending on other streams (the release below synchronises
  // the device anyway; without this, memory the caller has freed would be reported as missing),
  // then give every free segment back to the device and reserve again.
  if (pending_count > 0 && await_pending_frees_locked(/*all=*/true)) {
    if (block* b = pool.best_fit(stream, rounded)) return b;
    if (block* b = reserve_locked(pool, stream, rounded)) return b;  // a tail grown less
  }
  if (release_cached_locked() > 0) {
    if (block* b = reserve_locked(pool, stream, rounded)) return b;
  }
  // Step 6: a small request takes a free block of the large pool. The pools are kept apart so
  // that small blocks do not hold large segments, but a request that cached memory can serve
  // must not fail for it once the budget allows no new segment. Not with expandable segments
  // (their free blocks may be unmapped; the small pool grows by granules instead), nor from an
  // oversize block (never split). The caller takes the block from the pool of its segment.
  if (pool.small() && granularity == 0) {
    if (block* b = large_pool.best_fit(stream, rounded);
        b != nullptr && b->size < large_pool.max_split_size()) {
      ++stats.num_small_from_large;
      return b;
    }
  }
  // Step 7: fail; nothing has changed for the caller.
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
      try {
        idle_events.push_back(pe.event);  // kept for reuse: the only step that may throw
      } catch (...) {
        backend->destroy_event(pe.event);  // no host memory to keep it: the block still frees
      }
      queue.pop_front();
      --pending_count;
      if (--pe.blk->pending_events == 0) {
        free_block_locked(pe.blk);
        ++freed;
      }
    }
  }
  return freed;
}

// Waits (lock held) for the oldest pending event of each stream, or with `all` for the newest
// (events on a stream complete in order, so that is all of them). Only under pressure. A stream
// that cannot be waited for (a held sim stream, a device error) keeps its frees pending; the
// others are waited for and reaped all the same. False if nothing became free.
bool device_allocator::impl::await_pending_frees_locked(bool all) {
  for (auto& [s, queue] : pending) {
    if (queue.empty()) continue;
    try {
      backend->synchronize_event(all ? queue.back().event : queue.front().event);
    } catch (const std::exception&) {
    }
  }
  return reap_completed_events_locked() > 0;
}

// --- step 2: reserve -----------------------------------------------------------------------------

block* device_allocator::impl::reserve_locked(block_pool& pool, stream_ref stream,
                                              std::size_t rounded) {
  return granularity > 0 ? grow_expandable_locked(pool, stream, rounded)
                         : reserve_segment_locked(pool, stream, rounded);
}

void device_allocator::impl::segment_changed_locked(const segment& seg, int sign,
                                                    std::uintptr_t address,
                                                    std::size_t bytes) noexcept {
  if (config.on_segment_change) [[unlikely]] {
    const segment_change what =
        seg.expandable ? (sign > 0 ? segment_change::mapped : segment_change::unmapped)
                       : (sign > 0 ? segment_change::allocated : segment_change::freed);
    try {
      config.on_segment_change(what, reinterpret_cast<void*>(address), bytes, seg.stream);
    } catch (...) {
    }
  }
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
  if (seg.size >= large_pool.max_split_size()) {  // Note [Oversize blocks]; never when expandable
    if (sign > 0) stats.oversize_segments.increase(1); else stats.oversize_segments.decrease(1);
  }
}

block* device_allocator::impl::reserve_segment_locked(block_pool& pool, stream_ref stream,
                                                      std::size_t rounded) {
  // The preferred size, or the smallest that serves the request when the budget is tight.
  std::size_t size = size_classes::segment_size(rounded);
  if (!fits_budget_locked(size)) size = size_classes::min_segment_size(rounded);
  if (!fits_budget_locked(size)) return nullptr;

  segment* seg = segment_records.make();
  block* b = nullptr;
  try {
    b = block_records.make();
  } catch (...) {
    segment_records.recycle(seg);  // host memory ran out: nothing else has happened
    throw;
  }
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
  count_segments_locked(pool.small(), 1);
  segment_changed_locked(*seg, +1, seg->address, size);
  pool.insert(b);
  return b;
}

// --- step 4: pressure handlers ----------------------------------------------------------------------

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
  r.contiguous = granularity == 0;
  r.shortfall = budget_shortfall_locked(rounded);
  return r;
}

// The bytes over the budget that new memory for the request would take: whole granules
// (expandable), or its smallest segment.
std::size_t device_allocator::impl::budget_shortfall_locked(std::size_t rounded) const noexcept {
  const std::size_t need = reserved_locked() + least_reservation(rounded);
  return need > budget ? need - budget : 0;
}

pressure_result device_allocator::impl::run_pressure_handlers_releasing_lock(
    std::unique_lock<std::mutex>& lock, const pressure_request& request) {
  auto snapshot = handlers;  // handlers may be added or removed while the lock is released
  ++stats.num_pressure_handler_calls;
  lock.unlock();
  // Held again however this ends: a throw below (host out of memory for the failure's text or
  // the warning) reaches callers that hold the lock, as a return does.
  struct relock {
    std::unique_lock<std::mutex>& lock;
    ~relock() {
      if (!lock.owns_lock()) lock.lock();
    }
  } relock_on_exit{lock};
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

// --- steps 3 and 5: release -------------------------------------------------------------------------------

// What releasing `s` would give back now: the whole segment if it is free, or the whole free
// granules of an expandable segment's free blocks. Frees still waiting on events are not counted.
std::size_t device_allocator::impl::releasable_locked(const segment& s) const noexcept {
  if (!s.expandable) return s.fully_free() ? s.size : 0;
  std::size_t bytes = 0;
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (b->status == block_status::free) bytes += free_granules(b).second;
  }
  return bytes;
}

// O(1): the pools keep the sum as free blocks come and go (block_pool.hpp). It was a walk over
// every segment, and every block of the expandable ones, twice per allocation under the budget:
// 42% of ResNet-1202's replay with expandable segments on the simulated device.
std::size_t device_allocator::impl::releasable_bytes_locked() const noexcept {
  return small_pool.releasable() + large_pool.releasable();
}

// Gives free cached memory back to the device: every free segment and the whole free granules of
// expandable segments, or, with `enough`, only as many segments as give back that many bytes (the
// smallest that does alone, else the largest first), so that the cache keeps what it can.
// Returns the bytes released. See Note [Releasing memory to the device].
std::size_t device_allocator::impl::release_cached_locked(std::size_t enough) {
  if (enough == 0) return 0;
  // Frees pending on other streams are awaited first, as PyTorch's synchronize_and_free_events
  // does: the release synchronises the device anyway, and a block that becomes free may make its
  // segment free. A stream that cannot be waited for (a held sim stream) keeps its blocks pending.
  if (pending_count > 0) await_pending_frees_locked(/*all=*/true);
  const auto release = [this](segment* seg) {
    if (seg->expandable) return unmap_free_pages_locked(seg);
    const std::size_t bytes = seg->size;
    release_segment_locked(seg);
    return bytes;
  };
  // With `enough`, the chosen few: largest first (lowest address first among equals, so placement
  // stays deterministic), and before them all the smallest that covers `enough` alone, if any.
  std::vector<std::pair<std::size_t, segment*>> chosen;  // (bytes, segment)
  if (enough != all_cached) {
    for (segment& s : segments) {
      if (const std::size_t bytes = releasable_locked(s); bytes > 0) chosen.emplace_back(bytes, &s);
    }
    if (chosen.empty()) return 0;
    std::sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second->address < b.second->address;
    });
    const auto alone = std::find_if(chosen.rbegin(), chosen.rend(),
                                    [&](const auto& c) { return c.first >= enough; });
    if (alone != chosen.rend()) std::rotate(chosen.begin(), std::prev(alone.base()), alone.base());
  } else if (releasable_bytes_locked() == 0 &&
             (granularity == 0 || std::none_of(segments.begin(), segments.end(), [](const segment& s) {
                return s.expandable && s.first == nullptr;  // an empty range (expandable: few segments)
              }))) {
    return 0;  // synchronise only if something will be released
  }
  try {
    backend->synchronize_device();  // queued work may still touch free blocks of their own stream
    ++stats.num_sync_all_streams;
  } catch (const std::exception& e) {
    warn(std::string("spillway: cached memory kept: the device could not be synchronised (") +
         e.what() + ")");
    return 0;
  }
  std::size_t released = 0;
  if (enough == all_cached) {
    for (auto it = segments.begin(); it != segments.end();) {
      segment* seg = &*it++;  // released segments leave the list
      if (seg->expandable || seg->fully_free()) released += release(seg);
    }
    return released;
  }
  for (const auto& [bytes, seg] : chosen) {
    if (released >= enough) break;
    released += release(seg);
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
    segment_changed_locked(*seg, -1, seg->address, seg->size);
    backend->release_segment(reinterpret_cast<void*>(seg->address), seg->size);
    count_segments_locked(seg->small, -1);
  }
  segments.erase(segments.iterator_to(*seg));
  segments_by_address.erase(seg->address);
  segment_records.recycle(seg);
}

// --- budgets -----------------------------------------------------------------------------------------

budget_report device_allocator::impl::set_budget_releasing_lock(std::unique_lock<std::mutex>& lock,
                                                        std::size_t bytes, bool strict) {
  if (bytes == 0) {
    throw invalid_argument("spillway: set_budget(0) on device " + std::to_string(device) +
                           ": a budget must be at least 1 byte (unlimited_budget for none)");
  }
  budget_report report;
  const std::size_t old_budget = budget;
  const auto set_locked = [&](std::size_t b) {
    budget = b;
    stats.budget = b == unlimited_budget ? -1 : static_cast<std::int64_t>(b);
  };
  // A strict call that throws leaves the old budget in force, whatever throws (a refusal, host
  // memory for the handlers' list, a device error from an event query): lowered while the
  // handlers run, it would otherwise stay, and a scoped_budget whose construction threw would never
  // restore it. A call that accepts a budget below live memory sets it however it ends (a
  // scoped_budget's restore is one: the previous budget must come back).
  struct old_budget_unless_set {
    const decltype(set_locked)& set;
    std::size_t old;
    bool done = false;
    ~old_budget_unless_set() {
      if (!done) set(old);  // under the lock: the handlers' call takes it back on a throw
    }
  } restore_guard{set_locked, strict ? old_budget : bytes};
  const auto refuse = [&] {
    set_locked(old_budget);
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
      // Held to the new budget while the handlers run unlocked: other threads' allocations must
      // not take back what they free (a refusal puts the old one back).
      if (bytes < budget) set_locked(bytes);
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
  set_locked(bytes);
  restore_guard.done = true;
  report.budget = bytes;
  report.reserved = reserved_locked();
  report.shortfall = report.reserved > bytes ? report.reserved - bytes : 0;
  return report;
}

// --- step 7: fail ----------------------------------------------------------------------------------

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
