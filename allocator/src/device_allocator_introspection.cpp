// device_allocator_introspection.cpp: statistics, snapshot, describe, empty_cache and the
// reporting of problems that cannot be thrown.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <utility>

#include "device_allocator_impl.hpp"

namespace spillway {

using detail::block;
using detail::block_status;
using detail::segment;

namespace {
std::string hex(std::uintptr_t a) {
  char text[32];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(a));
  return text;
}
}  // namespace

void device_allocator::impl::warn(const std::string& message) const noexcept {
  if (message.empty()) return;  // none could be made (out of host memory)
  try {
    if (config.on_warning) {
      config.on_warning(message);
    } else {
      std::cerr << message << '\n';
    }
  } catch (...) {
    // A warning must never turn into a failure of the call that reports it.
  }
}

segment* device_allocator::impl::segment_containing_locked(std::uintptr_t address) const noexcept {
  auto it = segments_by_address.upper_bound(address);
  if (it == segments_by_address.begin()) return nullptr;
  --it;
  segment* seg = it->second;
  return address < seg->address + seg->address_range ? seg : nullptr;
}

// The message is left empty when the host has no memory for it: deallocate is noexcept, and a
// free must not end the process for want of a warning.
free_status device_allocator::impl::classify_invalid_free_locked(std::uintptr_t address,
                                                                 std::string& message) const noexcept {
  const segment* seg = segment_containing_locked(address);
  try {
    const std::string where = "spillway: deallocate(" + hex(address) + ") on device " +
                              std::to_string(device) + ": ";
    message = seg != nullptr
                  ? where + "not a live allocation (already freed, or not the start of a block) in the " +
                        format_bytes(seg->size) + " segment at " + hex(seg->address) + "; ignored"
                  : where + "unknown pointer, not allocated by spillway on this device; ignored";
  } catch (...) {
    message.clear();
  }
  return seg != nullptr ? free_status::not_live : free_status::unknown_pointer;
}

std::size_t device_allocator::impl::largest_free_locked() const noexcept {
  std::size_t largest = 0;
  for (const detail::block_pool* pool : {&small_pool, &large_pool}) {
    for (const block& b : pool->tree()) largest = std::max(largest, b.size);
  }
  return largest;
}

memory_stats device_allocator::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats;
}

void device_allocator::reset_peak_stats() {
  std::lock_guard lock(impl_->mutex);
  memory_stats& s = impl_->stats;
  for (stat_array* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                        &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                        &s.requested_bytes}) {
    for (stat& x : *a) x.reset_peak();
  }
  s.oversize_allocations.reset_peak();
  s.oversize_segments.reset_peak();
}

void device_allocator::reset_accumulated_stats() {
  std::lock_guard lock(impl_->mutex);
  memory_stats& s = impl_->stats;
  for (stat_array* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                        &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                        &s.requested_bytes}) {
    for (stat& x : *a) x.reset_accumulated();
  }
  s.oversize_allocations.reset_accumulated();
  s.oversize_segments.reset_accumulated();
  s.num_alloc_retries = s.num_ooms = s.num_sync_all_streams = 0;
  s.num_device_alloc = s.num_device_free = s.num_invalid_frees = 0;
  s.num_pressure_handler_calls = s.pressure_handler_freed_bytes = 0;
  s.num_releases_before_eviction = s.num_small_from_large = 0;
}

memory_snapshot device_allocator::snapshot() const {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  memory_snapshot snap;
  snap.segments.reserve(m.segments_by_address.size());
  for (const auto& [address, seg] : m.segments_by_address) {
    // One segment_info per run of mapped blocks: a plain segment is one run; an expandable one
    // has as many as its holes (unmapped blocks) leave (PyTorch reports them the same way).
    detail::for_each_mapped_run(*seg, [&](const block* first, const block* end) {
      segment_info info;
      info.device = m.device;
      info.address = first->address;
      info.stream = seg->stream;
      info.is_large = !seg->small;
      info.is_expandable = seg->expandable;
      for (const block* b = first; b != end; b = b->next) {
        block_info bi;
        bi.address = b->address;
        bi.size = b->size;
        bi.requested_size = b->requested_size;
        bi.state = b->status == block_status::free        ? block_state::inactive
                   : b->status == block_status::allocated ? block_state::active_allocated
                                                          : block_state::active_pending_free;
        info.total_size += b->size;
        if (bi.allocated()) info.allocated_size += b->size;
        if (bi.active()) {  // PyTorch sums requested sizes over active blocks
          info.active_size += b->size;
          info.requested_size += b->requested_size;
        }
        info.blocks.push_back(bi);
      }
      snap.segments.push_back(std::move(info));
    });
  }
  return snap;
}

allocation_info device_allocator::describe(const void* ptr) const {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr) {
    throw invalid_argument("spillway: describe(" + hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                           "): not a live allocation on device " + std::to_string(m.device));
  }
  allocation_info info;
  info.ptr = b->ptr();
  info.size = b->size;
  info.requested_size = b->requested_size;
  info.stream = b->stream;
  info.segment_base = reinterpret_cast<void*>(b->seg->address);
  info.segment_size = b->seg->size;
  return info;
}

namespace {
// The range [lo, hi) that freeing live block b would coalesce into: b and the runs of free and
// pending-free neighbours around it. Pending frees become free once their events complete (the
// pressure path waits for them), so they count: evicting several neighbours in a row builds one
// range.
std::pair<std::uintptr_t, std::uintptr_t> range_if_freed(const block* b) noexcept {
  const auto reclaimable = [](const block* n) {
    return n != nullptr &&
           (n->status == block_status::free || n->status == block_status::pending_free);
  };
  std::uintptr_t lo = b->address;
  std::uintptr_t hi = b->address + b->size;
  for (const block* n = b->prev; reclaimable(n); n = n->prev) lo = n->address;
  for (const block* n = b->next; reclaimable(n); n = n->next) hi = n->address + n->size;
  return {lo, hi};
}
}  // namespace

std::size_t device_allocator::coalesced_size_if_freed(const void* ptr) const noexcept {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr) return 0;
  const auto [lo, hi] = range_if_freed(b);
  return hi - lo;
}

std::size_t device_allocator::releasable_if_freed(const void* ptr) const noexcept {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const block* b = m.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr) return 0;
  const auto [lo, hi] = range_if_freed(b);
  if (!b->seg->expandable) return hi - lo == b->seg->size ? b->seg->size : 0;
  // Whole granules of [lo, hi), less those of its free parts beside b, which a release could
  // give back already.
  const std::uintptr_t end = b->address + b->size;
  return m.whole_granules(lo, hi).second - m.whole_granules(lo, b->address).second -
         m.whole_granules(end, hi).second;
}

// Note [Compaction]: what the eviction engine may empty by moving live blocks.
std::vector<segment_usage> device_allocator::partly_free_segments() const {
  const impl& m = *impl_;
  std::vector<segment_usage> out;
  std::lock_guard lock(m.mutex);
  if (m.granularity != 0) return out;
  for (const detail::segment& seg : m.segments) {
    // Free bytes are what its live and pending blocks leave (a fixed segment has no holes).
    if (seg.live_blocks == 0 || seg.pending_blocks != 0 || seg.allocated_bytes == seg.size) continue;
    segment_usage u;
    u.allocated_bytes = seg.allocated_bytes;
    u.live_blocks = seg.live_blocks;
    u.base = reinterpret_cast<void*>(seg.address);
    u.size = seg.size;
    u.small = seg.small;
    u.stream = seg.stream;
    out.push_back(u);
  }
  return out;
}

bool device_allocator::for_each_live_allocation(const void* segment_base,
                                                const std::function<bool(void*)>& f) const {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const auto it = m.segments_by_address.find(reinterpret_cast<std::uintptr_t>(segment_base));
  if (it == m.segments_by_address.end()) return false;
  for (const block* b = it->second->first; b != nullptr; b = b->next) {
    if (b->status == block_status::allocated && !f(b->ptr())) return false;
  }
  return true;
}

std::size_t device_allocator::cached_free_bytes() const noexcept {
  const std::lock_guard lock(impl_->mutex);
  return impl_->reserved_locked() - impl_->allocated_locked();
}

std::size_t device_allocator::releasable_bytes() const noexcept {
  const std::lock_guard lock(impl_->mutex);
  return impl_->releasable_bytes_locked();
}

bool device_allocator::fits_without_eviction(std::size_t bytes, stream_ref stream) const noexcept {
  if (bytes == 0) return true;  // served without memory
  if (bytes - 1 >= size_classes::max_request_size) return false;  // allocate refuses it
  const std::size_t rounded = size_classes::round_size(bytes);
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  if (m.pool_for(rounded).best_fit(stream, rounded) != nullptr) return true;
  if (m.budget_shortfall_locked(rounded) > 0) return false;
  // Within the budget, the device must still have the memory (other processes, other
  // allocators): a reservation it refuses goes down the pressure path too.
  try {
    return m.backend->free_memory() >= m.least_reservation(rounded);
  } catch (const std::exception&) {
    return false;  // the device cannot say: not free room, as far as this hint goes
  }
}

std::size_t device_allocator::largest_free_block() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->largest_free_locked();
}

std::size_t device_allocator::empty_cache() {
  std::lock_guard lock(impl_->mutex);
  impl_->reap_completed_events_locked();
  return impl_->release_cached_locked();
}

}  // namespace spillway
