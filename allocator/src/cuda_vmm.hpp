// cuda_vmm: the virtual memory half of the CUDA backend (expandable segments).
//
// Contract
// - The driver API is reached through cudaGetDriverEntryPointByVersion, never linked: the library
//   loads without libcuda. granularity() == 0 when an entry point is missing or the device has no
//   VMM support (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED); then no other method
//   may be called (they throw std::logic_error).
// - Physical memory is one CUmemGenericAllocationHandle per granularity page, device-local and
//   pinned, mapped read/write for this device only. Per-page handles make a partial unmap a plain
//   unmap + release of the pages concerned.
// - map() returns false when the device is out of memory, after unmapping and releasing the pages
//   it mapped itself; any other driver failure throws device_error after the same clean-up.
// - Addresses and sizes must be multiples of granularity() (invalid_argument otherwise).
// - unmap() / release() are noexcept and ignore driver errors; unmap() skips pages not mapped,
//   release() first unmaps pages still mapped in its range (cuMemAddressFree requires it).
// - Pages are mapped read/write for this device and for every peer grant_access() named: the
//   pages mapped when it is called, and every page mapped after (PyTorch's expandable segments
//   do the same for enablePeerAccess). A peer is named once; naming it again does nothing.
// - The caller makes the device current (cuda_call.hpp's device_guard) around every call,
//   including construction and destruction. All methods are thread-safe.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace spillway::cuda {

class vmm {
 public:
  explicit vmm(int device);
  ~vmm();  // unmaps and releases pages still mapped (best effort)

  vmm(const vmm&) = delete;
  vmm& operator=(const vmm&) = delete;

  std::size_t granularity() const noexcept { return granularity_; }
  // Why granularity() is 0, in words; "" when VMM is available.
  const std::string& unavailable_reason() const noexcept { return unavailable_reason_; }

  void* reserve(std::size_t bytes);  // nullptr when out of address space
  void release(void* base, std::size_t bytes) noexcept;
  bool map(void* addr, std::size_t bytes);
  void unmap(void* addr, std::size_t bytes) noexcept;
  // Lets device `peer` (a runtime index) read and write the pages: device_error when the driver
  // refuses (no peer access between the two devices), with nothing changed for later maps.
  void grant_access(int peer);

 private:
  // The driver functions VMM needs, at the ABI of CUDA 10.2 (unchanged through CUDA 13).
  struct driver_api {
    PFN_cuGetErrorName_v6000 get_error_name = nullptr;
    PFN_cuGetErrorString_v6000 get_error_string = nullptr;
    PFN_cuDeviceGet_v2000 device_get = nullptr;
    PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
    PFN_cuMemGetAllocationGranularity_v10020 get_granularity = nullptr;
    PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
    PFN_cuMemAddressFree_v10020 address_free = nullptr;
    PFN_cuMemCreate_v10020 create = nullptr;
    PFN_cuMemRelease_v10020 release = nullptr;
    PFN_cuMemMap_v10020 map = nullptr;
    PFN_cuMemUnmap_v10020 unmap = nullptr;
    PFN_cuMemSetAccess_v10020 set_access = nullptr;
  };
  using page_list = std::vector<std::pair<std::uintptr_t, CUmemGenericAllocationHandle>>;

  bool load_driver_api();  // false (and unavailable_reason_ set) when an entry point is missing
  void query_granularity();
  void require_vmm(const char* call) const;
  void check_aligned(const char* call, const void* addr, std::size_t bytes) const;
  // Unmaps and releases (page, handle) pairs: a page_list, or a range of pages_.
  template <class Pages>
  void unmap_pages(const Pages& pages) const noexcept;
  [[noreturn]] void throw_driver_error(CUresult res, const std::string& call) const;

  int device_;
  driver_api api_;
  CUmemAllocationProp prop_{};
  // This device's access, then each peer's (guarded by mutex_; map() sets them all).
  std::vector<CUmemAccessDesc> access_;
  std::set<std::uintptr_t> ranges_;  // bases of the reserved ranges (guarded by mutex_)
  std::size_t granularity_ = 0;
  std::string unavailable_reason_;

  std::mutex mutex_;
  std::map<std::uintptr_t, CUmemGenericAllocationHandle> pages_;  // mapped page -> its handle
};

}  // namespace spillway::cuda
