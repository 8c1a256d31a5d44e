// caching_allocator: one device_allocator per device, addressed by device index.
//
// Contract
// - Device indices run from 0 to device_count() - 1; any other index is invalid_argument naming the
//   index and the count.
// - deallocate(ptr) finds the owning device itself; a pointer no device owns is reported like
//   device_allocator::deallocate does (unknown_pointer), never a crash.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "spillway/device_allocator.hpp"

namespace spillway {

class caching_allocator {
 public:
  // One backend per device, in device-index order (backend i must report device_index() == i).
  explicit caching_allocator(std::vector<std::shared_ptr<device_backend>> backends,
                             allocator_config config = {});

  int device_count() const noexcept { return static_cast<int>(devices_.size()); }
  device_allocator& device(int index) const;

  void* allocate(int device, std::size_t bytes, stream_ref stream = {}) {
    return this->device(device).allocate(bytes, stream);
  }
  free_status deallocate(void* ptr) noexcept;
  device_allocator* owner_of(const void* ptr) const noexcept;  // nullptr if no device owns it

 private:
  std::vector<std::unique_ptr<device_allocator>> devices_;
};

}  // namespace spillway
