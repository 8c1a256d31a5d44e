// caching_allocator.cpp: routes calls to the device_allocator of each device.
#include "spillway/caching_allocator.hpp"

#include <cstdio>
#include <iostream>

#include "spillway/errors.hpp"

namespace spillway {

caching_allocator::caching_allocator(std::vector<std::shared_ptr<device_backend>> backends,
                                     allocator_config config) {
  devices_.reserve(backends.size());
  for (std::size_t i = 0; i < backends.size(); ++i) {
    if (!backends[i]) {
      throw invalid_argument("spillway: caching_allocator: backend " + std::to_string(i) +
                             " is nullptr");
    }
    if (backends[i]->device_index() != static_cast<int>(i)) {
      throw invalid_argument("spillway: caching_allocator: backend " + std::to_string(i) +
                             " reports device index " +
                             std::to_string(backends[i]->device_index()) + ", expected " +
                             std::to_string(i));
    }
    devices_.push_back(std::make_unique<device_allocator>(std::move(backends[i]), config));
  }
}

device_allocator& caching_allocator::device(int index) const {
  if (index < 0 || index >= device_count()) {
    throw invalid_argument("spillway: invalid device " + std::to_string(index) + ": expected 0.." +
                           std::to_string(device_count() - 1) + " (" +
                           std::to_string(device_count()) + " device(s))");
  }
  return *devices_[static_cast<std::size_t>(index)];
}

device_allocator* caching_allocator::owner_of(const void* ptr) const noexcept {
  for (const auto& d : devices_) {
    if (d->owns(ptr)) return d.get();
  }
  return nullptr;
}

free_status caching_allocator::deallocate(void* ptr) noexcept {
  if (devices_.size() == 1) return devices_.front()->deallocate(ptr);  // it reports unknown pointers
  if (device_allocator* d = owner_of(ptr)) return d->deallocate(ptr);
  // Nobody owns it: let device 0 classify and report it (it may be a stale pointer into a segment).
  return devices_.empty() ? free_status::unknown_pointer : devices_.front()->deallocate(ptr);
}

}  // namespace spillway
