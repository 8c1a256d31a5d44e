// device_allocator.cpp: the public methods and the fast paths.
//
// The allocation fast path (a cache hit) costs: one mutex lock/unlock, one rounding, one free-tree
// lower_bound (O(log n) in the free blocks of the pool), one live-table insert, and ten counter
// updates. A split adds one record from the arena and one tree insert. Anything else goes to
// allocate_slow_releasing_lock (device_allocator_slow_path.cpp).
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "device_allocator_impl.hpp"
#include "spillway/errors.hpp"

namespace spillway {

using detail::block;
using detail::block_pool;
using detail::block_status;

namespace {

// allocation / allocated_bytes change when the caller allocates and frees; requested_bytes with
// active (when the block is handed out and when it is really free again), as in PyTorch.
void update_block_stats(memory_stats& s, const block_pool& pool, std::int64_t sign,
                        std::int64_t size) noexcept {
  const int t = pool.small() ? static_cast<int>(stat_type::small_pool)
                             : static_cast<int>(stat_type::large_pool);
  for (int i : {0, t}) {
    if (sign > 0) {
      s.allocation[i].increase(1);
      s.allocated_bytes[i].increase(size);
    } else {
      s.allocation[i].decrease(1);
      s.allocated_bytes[i].decrease(size);
    }
  }
  if (static_cast<std::size_t>(size) >= pool.max_split_size()) [[unlikely]] {
    if (sign > 0) s.oversize_allocations.increase(1); else s.oversize_allocations.decrease(1);
  }
}

void update_active_stats(memory_stats& s, const block_pool& pool, std::int64_t sign,
                         std::int64_t size, std::int64_t requested) noexcept {
  const int t = pool.small() ? static_cast<int>(stat_type::small_pool)
                             : static_cast<int>(stat_type::large_pool);
  for (int i : {0, t}) {
    if (sign > 0) {
      s.active[i].increase(1);
      s.active_bytes[i].increase(size);
      s.requested_bytes[i].increase(requested);
    } else {
      s.active[i].decrease(1);
      s.active_bytes[i].decrease(size);
      s.requested_bytes[i].decrease(requested);
    }
  }
}

[[noreturn]] void throw_bad_size(std::size_t bytes, int device) {
  std::ostringstream m;
  if (bytes == 0) {
    m << "spillway: allocate(0) on device " << device << ": the size must be at least 1 byte";
  } else {
    m << "spillway: allocate(" << bytes << ") on device " << device << ": the size ("
      << format_bytes(bytes) << ") exceeds the largest request spillway accepts ("
      << format_bytes(size_classes::max_request_size) << ")";
  }
  throw invalid_argument(m.str());
}

}  // namespace

device_allocator::impl::impl(std::shared_ptr<device_backend> b, allocator_config c)
    : backend(std::move(b)), config(std::move(c)) {
  if (!backend) throw invalid_argument("spillway: device_allocator needs a backend, got nullptr");
  device = backend->device_index();
  budget = config.budget;
  if (budget == 0) {
    throw invalid_argument("spillway: a budget of 0 bytes on device " + std::to_string(device) +
                           " can hold nothing; use unlimited_budget for no budget");
  }
  stats.budget = budget == unlimited_budget ? -1 : static_cast<std::int64_t>(budget);
  if (config.expandable_address_range > size_classes::max_request_size) {  // it is rounded up
    throw invalid_argument("spillway: expandable_address_range of " +
                           std::to_string(config.expandable_address_range) + " bytes on device " +
                           std::to_string(device) + ": expected at most " +
                           format_bytes(size_classes::max_request_size) + " (0: the device's memory)");
  }
  if (config.expandable_segments) {
    granularity = backend->vmm_granularity();
    small_pool.set_granularity(granularity);
    large_pool.set_granularity(granularity);
    if (granularity == 0) {
      warn("spillway: expandable_segments ignored on " + backend->name() +
           ": the backend has no virtual memory management");
    }
  }
  set_max_split_size_locked();
}

// Note [Oversize blocks]: the limit applies to the large pool of fixed segments.
void device_allocator::impl::set_max_split_size_locked() {
  const std::size_t limit = config.max_split_size;
  if (limit == no_split_limit) return;
  if (limit <= size_classes::large_segment_size) {
    throw invalid_argument("spillway: max_split_size of " + std::to_string(limit) + " bytes (" +
                           format_bytes(limit) + ") on device " + std::to_string(device) +
                           ": expected more than " +
                           format_bytes(size_classes::large_segment_size) +
                           " (the large pool's segment size), or no_split_limit");
  }
  if (granularity != 0) {
    warn("spillway: max_split_size ignored on device " + std::to_string(device) +
         ": expandable segments split off and unmap any remainder");
    return;
  }
  large_pool.set_max_split_size(limit);
  stats.max_split_size = static_cast<std::int64_t>(limit);
}

// --- the fast path -----------------------------------------------------------------------------

void* device_allocator::allocate(std::size_t bytes, stream_ref stream) {
  impl& m = *impl_;
  // One compare rejects both 0 (wraps around) and sizes over the limit.
  if (bytes - 1 >= size_classes::max_request_size) [[unlikely]] throw_bad_size(bytes, m.device);
  const std::size_t rounded = size_classes::round_size(bytes);
  block_pool& pool = m.pool_for(rounded);

  std::unique_lock lock(m.mutex);
  block* b = pool.best_fit(stream, rounded);  // cache hit: the smallest cached block that fits
  if (b == nullptr) [[unlikely]] {
    b = m.allocate_slow_releasing_lock(lock, pool, stream, rounded, bytes);
    m.take_block_locked(m.pool_of(b), b, rounded, bytes);  // the large pool's, in its step 6
    return b->ptr();
  }
  m.take_block_locked(pool, b, rounded, bytes);
  return b->ptr();
}

// Note [Compaction]: the fast path's best fit and split, from cached blocks only.
void* device_allocator::allocate_cached(std::size_t bytes, stream_ref stream, const void* outside) {
  impl& m = *impl_;
  if (bytes - 1 >= size_classes::max_request_size) [[unlikely]] throw_bad_size(bytes, m.device);
  const std::size_t rounded = size_classes::round_size(bytes);
  block_pool& pool = m.pool_for(rounded);

  std::lock_guard lock(m.mutex);
  const detail::segment* avoid =
      outside != nullptr ? m.segment_containing_locked(reinterpret_cast<std::uintptr_t>(outside))
                         : nullptr;
  block* b = pool.best_fit_in_use(stream, rounded, avoid);
  if (b == nullptr) return nullptr;
  m.take_block_locked(pool, b, rounded, bytes);
  return b->ptr();
}

void device_allocator::impl::take_block_locked(block_pool& pool, block* b, std::size_t rounded,
                                               std::size_t requested) {
  // Everything that can throw (record allocation, table growth) happens before any change.
  live.reserve_one();
  block* rest = splits_locked(*b, rounded) ? block_records.make() : nullptr;

  block_pool::split_delta net;  // applied once, as PyTorch's allocation changes it
  pool.erase(b, net);
  if (rest != nullptr) {  // split: b keeps the low addresses, the remainder stays cached
    rest->address = b->address + rounded;
    rest->size = b->size - rounded;
    rest->stream = b->stream;
    rest->seg = b->seg;
    rest->prev = b;
    rest->next = b->next;
    if (b->next != nullptr) b->next->prev = rest; else b->seg->tail = rest;
    b->next = rest;
    b->size = rounded;
    pool.insert(rest, net);
  }
  pool.apply(net);
  b->status = block_status::allocated;
  b->requested_size = requested;
  ++b->seg->live_blocks;
  b->seg->allocated_bytes += b->size;
  live.insert(b);
  update_block_stats(stats, pool, +1, static_cast<std::int64_t>(b->size));
  update_active_stats(stats, pool, +1, static_cast<std::int64_t>(b->size),
                      static_cast<std::int64_t>(requested));
}

free_status device_allocator::deallocate(void* ptr) noexcept {
  if (ptr == nullptr) return free_status::null_pointer;  // like cudaFree(nullptr): nothing to do
  impl& m = *impl_;
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  std::string message;
  free_status status;
  {
    std::lock_guard lock(m.mutex);
    block* b = m.live.find(address);
    if (b != nullptr) [[likely]] {
      m.live.erase(b);
      ++m.num_frees;
      --b->seg->live_blocks;
      b->seg->allocated_bytes -= b->size;
      update_block_stats(m.stats, m.pool_of(b), -1, static_cast<std::int64_t>(b->size));
      if (b->stream_uses.empty()) [[likely]] {  // only its own stream used it: reusable at once
        m.free_block_locked(b);
        return free_status::freed;
      }
      // Freed at once after all when no event could be recorded and the streams were waited for.
      return m.defer_free_locked(b) ? free_status::freed : free_status::deferred;
    }
    ++m.stats.num_invalid_frees;
    status = m.classify_invalid_free_locked(address, message);
  }
  m.warn(message);  // outside the lock: the handler is the user's code
  return status;
}

// Returns a block to its pool, coalescing it with free neighbours. See Note [Block tiling].
void device_allocator::impl::free_block_locked(block* b) noexcept {
  if (config.on_free_completed) [[unlikely]] {  // before the block can be handed out again
    try {
      config.on_free_completed(reinterpret_cast<void*>(b->address), b->requested_size, b->stream);
    } catch (...) {
    }
  }
  if (b->status == block_status::pending_free) --b->seg->pending_blocks;
  block_pool& pool = pool_of(b);
  update_active_stats(stats, pool, -1, static_cast<std::int64_t>(b->size),
                      static_cast<std::int64_t>(b->requested_size));
  b->requested_size = 0;
  b->stream_uses.clear();
  insert_free_locked(b);
}

// Marks b free and puts it in its pool, merged with its free neighbours (not unmapped ones).
void device_allocator::impl::insert_free_locked(block* b) noexcept {
  block_pool& pool = pool_of(b);
  block_pool::split_delta net;  // applied once, as PyTorch's free changes it
  b->status = block_status::free;
  if (block* p = b->prev; p != nullptr && p->status == block_status::free) {
    pool.erase(p, net);
    b->address = p->address;
    b->size += p->size;
    b->prev = p->prev;
    if (b->prev != nullptr) b->prev->next = b; else b->seg->first = b;
    block_records.recycle(p);
  }
  if (block* n = b->next; n != nullptr && n->status == block_status::free) {
    pool.erase(n, net);
    b->size += n->size;
    b->next = n->next;
    if (b->next != nullptr) b->next->prev = b; else b->seg->tail = b;
    block_records.recycle(n);
  }
  pool.insert(b, net);
  pool.apply(net);
}

// Records an event on every other stream that used the block; the block becomes free when all of
// them have completed (reap_completed_events_locked). See Note [Cross-stream frees].
bool device_allocator::impl::defer_free_locked(block* b) noexcept {
  b->status = block_status::pending_free;
  ++b->seg->pending_blocks;
  for (stream_ref s : b->stream_uses) {
    event_ref e{};  // taken and not yet queued: given back if a later step throws
    try {
      if (idle_events.empty()) {
        e = backend->create_event();
      } else {
        e = idle_events.back();
        idle_events.pop_back();
      }
      backend->record_event(e, s);
      auto it = std::find_if(pending.begin(), pending.end(),
                             [s](const auto& q) { return q.first == s; });
      if (it == pending.end()) it = pending.insert(pending.end(), {s, {}});
      it->second.push_back({e, b});
      ++b->pending_events;
      ++pending_count;
    } catch (const std::exception& error) {
      if (e.value != 0) {
        try {
          idle_events.push_back(e);  // a recorded event is reused as well: a record replaces it
        } catch (...) {
          backend->destroy_event(e);
        }
      }
      // No event: wait for the stream instead. If even that fails the block is leaked, never
      // reused early: losing memory is better than corrupting data.
      try {
        backend->synchronize_stream(s);
      } catch (const std::exception& sync_error) {
        ++b->pending_events;  // never reaped
        try {  // noexcept: without host memory for the message, the leak goes unreported
          warn(std::string("spillway: cannot order the free of a block on device ") +
               std::to_string(device) + " after stream " + std::to_string(s.value) + " (" +
               error.what() + "; " + sync_error.what() + "); its " + format_bytes(b->size) +
               " are leaked rather than reused early");
        } catch (...) {
        }
      }
    }
  }
  if (b->pending_events != 0) return false;
  free_block_locked(b);
  return true;
}

void device_allocator::record_stream(void* ptr, stream_ref stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr) {
    throw invalid_argument("spillway: record_stream(" + format_pointer(ptr) + ", stream " +
                           std::to_string(stream.value) + "): the pointer is not a live "
                           "allocation on device " + std::to_string(m.device));
  }
  if (stream == b->stream) return;  // its own stream orders the free already
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
    b->stream_uses.push_back(stream);
  }
}

// --- construction, ownership and configuration -------------------------------------------------

device_allocator::device_allocator(std::shared_ptr<device_backend> backend, allocator_config config)
    : impl_(std::make_unique<impl>(std::move(backend), std::move(config))) {}

device_allocator::~device_allocator() {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  // Frees still waiting on events are not a leak: the synchronisation below completes them.
  if (m.live.size() > 0) {
    m.warn("spillway: device_allocator on device " + std::to_string(m.device) + " destroyed with " +
           std::to_string(m.live.size()) + " live allocation(s) (" +
           format_bytes(m.allocated_locked()) + "); their memory is released to the device");
  }
  try {
    m.backend->synchronize_device();
  } catch (const std::exception& e) {
    m.warn(std::string("spillway: device synchronisation failed during teardown: ") + e.what());
  }
  for (auto& [s, q] : m.pending) {
    for (auto& pe : q) m.backend->destroy_event(pe.event);
  }
  for (event_ref e : m.idle_events) m.backend->destroy_event(e);
  m.small_pool.tree().clear();
  m.large_pool.tree().clear();
  while (!m.segments.empty()) {
    detail::segment& seg = m.segments.front();
    m.segments.pop_front();
    if (seg.expandable) {  // unmapped run by run: holes and the top are granule-aligned
      seg.holes.clear();
      detail::for_each_mapped_run(seg, [&](const detail::block* first, const detail::block* end) {
        const std::uintptr_t stop = end != nullptr ? end->address : seg.address + seg.size;
        m.backend->unmap_physical(first->ptr(), stop - first->address);
      });
      m.backend->release_address_range(reinterpret_cast<void*>(seg.address), seg.address_range);
    } else {
      m.backend->release_segment(reinterpret_cast<void*>(seg.address), seg.size);
    }
  }
  m.live.clear();
}

bool device_allocator::owns(const void* ptr) const noexcept {
  std::lock_guard lock(impl_->mutex);
  return impl_->live.find(reinterpret_cast<std::uintptr_t>(ptr)) != nullptr;
}

bool device_allocator::holds(const void* ptr) const noexcept {
  std::lock_guard lock(impl_->mutex);
  return impl_->segment_containing_locked(reinterpret_cast<std::uintptr_t>(ptr)) != nullptr;
}

budget_report device_allocator::set_budget(std::size_t bytes, below_live when_below) {
  std::unique_lock lock(impl_->mutex);
  return impl_->set_budget_releasing_lock(lock, bytes, /*strict=*/when_below == below_live::refuse);
}

std::size_t device_allocator::budget() const noexcept {
  std::lock_guard lock(impl_->mutex);
  return impl_->budget;
}

pressure_handler_id device_allocator::add_pressure_handler(pressure_handler handler) {
  if (!handler) throw invalid_argument("spillway: add_pressure_handler: the handler is empty");
  auto shared = std::make_shared<const pressure_handler>(std::move(handler));
  std::lock_guard lock(impl_->mutex);
  const pressure_handler_id id = impl_->next_handler_id++;
  impl_->handlers.emplace_back(id, std::move(shared));
  return id;
}

void device_allocator::remove_pressure_handler(pressure_handler_id id) noexcept {
  std::lock_guard lock(impl_->mutex);
  auto& h = impl_->handlers;
  h.erase(std::remove_if(h.begin(), h.end(), [id](const auto& e) { return e.first == id; }),
          h.end());
}

int device_allocator::device() const noexcept { return impl_->device; }
device_backend& device_allocator::backend() const noexcept { return *impl_->backend; }
const allocator_config& device_allocator::config() const noexcept { return impl_->config; }

// --- scoped_budget -------------------------------------------------------------------------------

scoped_budget::scoped_budget(device_allocator& allocator, std::size_t bytes)
    : allocator_(allocator), previous_(allocator.budget()), report_(allocator.set_budget(bytes)) {}

scoped_budget::~scoped_budget() {
  // A restore is never refused: the previous budget comes back even if it cannot be met yet.
  device_allocator::impl& m = *allocator_.impl_;
  std::unique_lock lock(m.mutex);
  try {
    const budget_report r = m.set_budget_releasing_lock(lock, previous_, /*strict=*/false);
    if (!r.met()) {
      m.warn("spillway: restoring the budget of " + format_bytes(previous_) + " on device " +
             std::to_string(m.device) + " left " + format_bytes(r.shortfall) +
             " reserved above it; allocations that need new memory will wait for frees");
    }
  } catch (const std::exception& e) {
    m.warn(std::string("spillway: restoring the budget failed: ") + e.what());
  }
}

}  // namespace spillway
