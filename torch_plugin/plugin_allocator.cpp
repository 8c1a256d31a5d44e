// plugin_allocator.cpp: per-device allocators created on first use, and the routing of frees.
// The contract is in plugin_allocator.hpp.
#include "plugin_allocator.hpp"

#include <algorithm>

#include "spillway/errors.hpp"

namespace spillway {

plugin_allocator::plugin_allocator(plugin_config config, int device_count,
                                   backend_factory make_backend, device_observers observers)
    : config_(std::move(config)),
      device_count_(device_count),
      make_backend_(std::move(make_backend)),
      observers_(std::move(observers)) {
  if (device_count_ < 0) {
    throw invalid_argument("spillway: plugin_allocator: device count " + std::to_string(device_count_) +
                           " is invalid: expected >= 0");
  }
  if (config_.device && *config_.device >= device_count_) {
    // Else the budget would silently apply to no device (CUDA_VISIBLE_DEVICES renumbers them).
    throw invalid_argument("spillway: SPILLWAY_CONF device:" + std::to_string(*config_.device) +
                           " names no device: expected 0.." + std::to_string(device_count_ - 1) +
                           " (" + std::to_string(device_count_) + " device(s) visible with backend " +
                           config_.backend + ")");
  }
  if (!make_backend_) {
    throw invalid_argument("spillway: plugin_allocator: the backend factory is empty: expected a "
                           "function that makes a device's backend (make_backends)");
  }
  slots_ = std::make_unique<std::atomic<device_allocator*>[]>(static_cast<std::size_t>(device_count_));
  for (int i = 0; i < device_count_; ++i) slots_[i].store(nullptr, std::memory_order_relaxed);
}

plugin_allocator::~plugin_allocator() = default;

device_allocator* plugin_allocator::created_device(int index) const noexcept {
  if (index < 0 || index >= device_count_) return nullptr;
  return slots_[index].load(std::memory_order_acquire);
}

device_allocator& plugin_allocator::device(int index) {
  if (device_allocator* d = created_device(index)) return *d;  // the common case: no lock
  if (index < 0 || index >= device_count_) {
    throw invalid_argument("spillway: invalid device " + std::to_string(index) + ": expected 0.." +
                           std::to_string(device_count_ - 1) + " (" + std::to_string(device_count_) +
                           " device(s) with backend " + config_.backend + ")");
  }
  std::lock_guard lock(create_mutex_);
  if (device_allocator* d = slots_[index].load(std::memory_order_acquire)) return *d;
  std::shared_ptr<device_backend> backend = make_backend_(index);
  allocator_config ac = config_.allocator;
  ac.budget = budget_for_device(config_, index, backend->total_memory());
  if (observers_.on_warning) ac.on_warning = observers_.on_warning;
  if (observers_.on_free_completed) {
    ac.on_free_completed = [observer = observers_.on_free_completed, index](
                               void* ptr, std::size_t size, stream_ref stream) {
      observer(index, ptr, size, stream);
    };
  }
  if (observers_.on_segment_change) {
    ac.on_segment_change = [observer = observers_.on_segment_change, index](
                               segment_change what, void* address, std::size_t bytes,
                               stream_ref stream) { observer(index, what, address, bytes, stream); };
  }
  owned_.push_back(std::make_unique<device_allocator>(std::move(backend), std::move(ac)));
  device_allocator& created = *owned_.back();
  for (handler_entry& h : handlers_) h.per_device[index] = created.add_pressure_handler(h.handler);
  slots_[index].store(&created, std::memory_order_release);
  return created;
}

std::uint64_t plugin_allocator::add_pressure_handler(pressure_handler handler) {
  std::lock_guard lock(create_mutex_);
  handler_entry entry{next_handler_id_++, std::move(handler),
                      std::vector<pressure_handler_id>(static_cast<std::size_t>(device_count_), 0)};
  for (int i = 0; i < device_count_; ++i) {
    if (device_allocator* d = slots_[i].load(std::memory_order_acquire)) {
      entry.per_device[i] = d->add_pressure_handler(entry.handler);
    }
  }
  handlers_.push_back(std::move(entry));
  return handlers_.back().id;
}

void plugin_allocator::remove_pressure_handler(std::uint64_t id) noexcept {
  std::lock_guard lock(create_mutex_);
  auto it = std::find_if(handlers_.begin(), handlers_.end(),
                         [id](const handler_entry& h) { return h.id == id; });
  if (it == handlers_.end()) return;
  for (int i = 0; i < device_count_; ++i) {
    if (it->per_device[i] != 0) slots_[i].load()->remove_pressure_handler(it->per_device[i]);
  }
  handlers_.erase(it);
}

stream_ref plugin_allocator::stream_of(const void* cuda_stream) const noexcept {
  const auto value = reinterpret_cast<std::uintptr_t>(cuda_stream);
  return stream_ref{value == 1 && config_.backend == "cuda" ? 0 : value};
}

void* plugin_allocator::allocate(int device_index, std::size_t bytes, stream_ref stream) {
  device_allocator& d = device(device_index);  // an invalid device is an error even for 0 bytes
  if (bytes == 0) return nullptr;
  return d.allocate(bytes, stream);
}

device_allocator* plugin_allocator::owner_of(const void* ptr) const noexcept {
  if (ptr == nullptr) return nullptr;
  for (int i = 0; i < device_count_; ++i) {
    device_allocator* d = created_device(i);
    if (d != nullptr && d->owns(ptr)) return d;
  }
  return nullptr;
}

device_allocator* plugin_allocator::holder_of(const void* ptr) const noexcept {
  if (ptr == nullptr) return nullptr;
  for (int i = 0; i < device_count_; ++i) {
    device_allocator* d = created_device(i);
    if (d != nullptr && d->holds(ptr)) return d;
  }
  return nullptr;
}

free_result plugin_allocator::deallocate(void* ptr, device_allocator** holder) noexcept {
  // Live first (one hash lookup per created device); only a miss looks at the segments.
  device_allocator* d = owner_of(ptr);
  if (d == nullptr) d = holder_of(ptr);
  if (holder != nullptr) *holder = d;
  if (d == nullptr) return free_result::foreign;
  switch (d->deallocate(ptr)) {  // a not-live pointer is reported by the device allocator itself
    case free_status::freed: return free_result::freed;
    case free_status::deferred: return free_result::deferred;
    case free_status::unknown_pointer:  // released between the lookup and the free: a double free
    case free_status::not_live: return free_result::invalid;
    case free_status::null_pointer: return free_result::foreign;  // not reached: owner_of(nullptr) is null
  }
  return free_result::invalid;
}

memory_info plugin_allocator::memory_info_of(int device_index) {
  device_allocator& d = device(device_index);
  const memory_stats s = d.stats();
  const auto reserved = static_cast<std::size_t>(std::max<std::int64_t>(0, s.reserved_bytes[0].current));
  const auto allocated = static_cast<std::size_t>(std::max<std::int64_t>(0, s.allocated_bytes[0].current));
  const std::size_t budget = d.budget();
  const std::size_t device_total = d.backend().total_memory();
  const std::size_t device_free = d.backend().free_memory();

  memory_info info;
  info.total = std::min(budget, device_total);
  const std::size_t headroom = std::min(budget > reserved ? budget - reserved : 0, device_free);
  const std::size_t cached = reserved > allocated ? reserved - allocated : 0;
  info.free = std::min(headroom + cached, info.total);
  info.headroom = std::min(headroom, info.total);
  return info;
}

std::size_t plugin_allocator::empty_cache() {
  std::size_t released = 0;
  for (int i = 0; i < device_count_; ++i) {
    if (device_allocator* d = created_device(i)) released += d->empty_cache();
  }
  return released;
}

}  // namespace spillway
