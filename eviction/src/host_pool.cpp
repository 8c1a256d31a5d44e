// host_pool.cpp: the pinned host cache behind spills. The contract is in host_pool.hpp.
//
// A block is in exactly one of three places: handed_out_ (the caller has it), pending_ (given
// back with free_after, its event not yet complete) or cached_ (reusable). sizes_ knows all of
// them. held_bytes counts all three, in_use_bytes the first two.
//
// allocate is noexcept: bookkeeping that fails to allocate (bad_alloc) and a backend that throws
// instead of returning nullptr are both reported as "no memory", with nothing changed.
#include "spillway/eviction/host_pool.hpp"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>

#include "spillway/errors.hpp"

namespace spillway::eviction {
namespace {

constexpr std::size_t k_small_step = std::size_t{4} << 10;  // 4 KiB
constexpr std::size_t k_large_step = std::size_t{2} << 20;  // 2 MiB

}  // namespace

host_pool::host_pool(device_backend& backend, std::size_t capacity)
    : backend_(backend), capacity_(capacity) {}

host_pool::~host_pool() {
  std::lock_guard lock(mutex_);
  for (auto& [event, ptr] : pending_) {
    bool waited = true;
    try {
      backend_.synchronize_event(event);
    } catch (...) {  // e.g. a held simulated stream: the copy may still read the block
      waited = false;
    }
    backend_.destroy_event(event);
    if (!waited) sizes_.erase(ptr);  // leaked on purpose, see host_pool.hpp
  }
  for (auto& [ptr, bytes] : sizes_) backend_.free_pinned_host(const_cast<void*>(ptr), bytes);
}

// Sizes over SIZE_MAX - 2 MiB cannot be rounded; they saturate at SIZE_MAX, which no pool can
// hold, so allocate fails for them like for any size over the capacity.
std::size_t host_pool::round_size(std::size_t bytes) noexcept {
  if (bytes <= k_large_step) return std::max(k_small_step, (bytes + k_small_step - 1) & ~(k_small_step - 1));
  if (bytes > std::numeric_limits<std::size_t>::max() - (k_large_step - 1))
    return std::numeric_limits<std::size_t>::max();
  return (bytes + k_large_step - 1) & ~(k_large_step - 1);
}

void* host_pool::allocate(std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  reap_locked();
  void* ptr = allocate_locked(round_size(bytes));
  if (ptr == nullptr) ++stats_.failed_allocations;
  return ptr;
}

void* host_pool::allocate_locked(std::size_t rounded) noexcept {
  // Best fit among cached blocks, at most 25% larger than the request.
  auto it = cached_.lower_bound(rounded);
  if (it != cached_.end() && it->first - rounded <= rounded / 4) {
    void* ptr = it->second;
    try {
      handed_out_.insert(ptr);
    } catch (...) {
      return nullptr;
    }
    stats_.in_use_bytes += it->first;
    ++stats_.cache_hits;
    cached_.erase(it);
    return ptr;
  }
  // A miss: make room under the capacity with cached blocks that did not fit, then ask the backend.
  if (rounded > capacity_) return nullptr;
  const std::size_t room = capacity_ - stats_.held_bytes;
  if (rounded > room) release_cached_locked(rounded - room);
  if (rounded > capacity_ - stats_.held_bytes) return nullptr;
  return allocate_from_backend_locked(rounded);
}

void* host_pool::allocate_from_backend_locked(std::size_t rounded) noexcept {
  auto ask = [&]() noexcept -> void* {
    try {
      return backend_.allocate_pinned_host(rounded);
    } catch (...) {
      return nullptr;
    }
  };
  void* ptr = ask();
  // The backend is out of pinned memory: what we cache may be the reason. Retry only when giving
  // it back changed something; a second failing cudaHostAlloc is not free.
  if (ptr == nullptr && release_cached_locked(std::numeric_limits<std::size_t>::max()) > 0) ptr = ask();
  if (ptr == nullptr) return nullptr;
  try {
    sizes_.emplace(ptr, rounded);
    handed_out_.insert(ptr);
  } catch (...) {
    sizes_.erase(ptr);
    backend_.free_pinned_host(ptr, rounded);
    return nullptr;
  }
  stats_.held_bytes += rounded;
  stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
  stats_.in_use_bytes += rounded;
  ++stats_.backend_allocations;
  return ptr;
}

std::size_t host_pool::handed_out_size_locked(const void* ptr, const char* call) const {
  if (handed_out_.count(ptr) == 0) {
    throw invalid_argument(std::string("host_pool::") + call + "(" + format_pointer(ptr) +
                           "): not a block this pool handed out (unknown, interior, null or "
                           "already freed)");
  }
  return sizes_.at(ptr);
}

void host_pool::free(void* ptr) {
  std::lock_guard lock(mutex_);
  const std::size_t bytes = handed_out_size_locked(ptr, "free");
  reap_locked();
  cached_.emplace(bytes, ptr);  // the only step that may throw (bad_alloc): before any change
  handed_out_.erase(ptr);
  stats_.in_use_bytes -= bytes;
}

void host_pool::free_after(void* ptr, event_ref event) {
  std::lock_guard lock(mutex_);
  handed_out_size_locked(ptr, "free_after");
  reap_locked();
  pending_.emplace_back(event, ptr);  // may throw (bad_alloc): before any change
  handed_out_.erase(ptr);             // still in use until the event completes
}

std::size_t host_pool::block_size(const void* ptr) const {
  std::lock_guard lock(mutex_);
  return handed_out_size_locked(ptr, "block_size");
}

std::size_t host_pool::release_cached() noexcept {
  std::lock_guard lock(mutex_);
  reap_locked();
  return release_cached_locked(std::numeric_limits<std::size_t>::max());
}

// Gives cached blocks back, largest first, until at least `wanted` bytes are released or none is
// left. Returns the bytes released.
std::size_t host_pool::release_cached_locked(std::size_t wanted) noexcept {
  std::size_t released = 0;
  while (released < wanted && !cached_.empty()) {
    auto last = std::prev(cached_.end());
    const auto [bytes, ptr] = *last;
    cached_.erase(last);
    sizes_.erase(ptr);
    backend_.free_pinned_host(ptr, bytes);
    stats_.held_bytes -= bytes;
    released += bytes;
  }
  return released;
}

std::size_t host_pool::room() noexcept {
  std::lock_guard lock(mutex_);
  reap_locked();
  return capacity_ > stats_.in_use_bytes ? capacity_ - stats_.in_use_bytes : 0;
}

host_pool_stats host_pool::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// Moves the blocks whose event has completed to the cache and destroys their events. An event
// whose query throws stays pending (and is waited for by the destructor).
void host_pool::reap_locked() noexcept {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    const auto [event, ptr] = pending_[i];
    const std::size_t bytes = sizes_.find(ptr)->second;
    bool done = false;
    try {
      done = backend_.event_completed(event);
      if (done) cached_.emplace(bytes, ptr);
    } catch (...) {  // a failing query, or bad_alloc in the cache: try again on the next call
      done = false;
    }
    if (done) {
      backend_.destroy_event(event);
      stats_.in_use_bytes -= bytes;
    } else {
      pending_[kept++] = pending_[i];
    }
  }
  pending_.resize(kept);
}

}  // namespace spillway::eviction
