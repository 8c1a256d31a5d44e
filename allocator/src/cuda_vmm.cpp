// cuda_vmm.cpp: driver-API virtual memory, one physical handle per granularity page.
#include "cuda_vmm.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <ranges>
#include <stdexcept>

#include "cuda_call.hpp"
#include "spillway/errors.hpp"

namespace spillway::cuda {
namespace {

// The CUDA version whose ABI the PFN_*_v10020 / v6000 / v2000 typedefs above describe. Asking for
// an explicit version (rather than "whatever this runtime was built with") keeps the signatures
// and the pointers we get in step when the driver adds a newer variant of a symbol.
constexpr unsigned k_driver_abi = 12000;

template <class Fn>
bool load(Fn& out, const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, k_driver_abi, cudaEnableDefault, &status);
  if (err != cudaSuccess) {
    clear_error(err);  // reported as "no VMM", not later by an unrelated check
    return false;
  }
  if (status != cudaDriverEntryPointSuccess || fn == nullptr) return false;
  out = reinterpret_cast<Fn>(fn);
  return true;
}

// "0x7f00000000, 2.00 MiB", or just the size when there is no address yet.
std::string range_text(const void* addr, std::size_t bytes) {
  if (addr == nullptr) return format_bytes(bytes);
  return format_pointer(addr) + ", " + format_bytes(bytes);
}

}  // namespace

vmm::vmm(int device) : device_(device) {
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = device;  // runtime device index == driver ordinal (both honour CUDA_VISIBLE_DEVICES)
  CUmemAccessDesc own{};
  own.location = prop_.location;
  own.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  access_.push_back(own);
  if (load_driver_api()) query_granularity();
}

template <class Pages>
void vmm::unmap_pages(const Pages& pages) const noexcept {
  // Errors are ignored: this runs on release paths and at teardown, when the driver may be gone.
  for (const auto& [page, handle] : pages) {
    (void)api_.unmap(static_cast<CUdeviceptr>(page), granularity_);
    (void)api_.release(handle);
  }
}

vmm::~vmm() {
  std::lock_guard lock(mutex_);
  unmap_pages(pages_);  // in place: a destructor must not allocate
  pages_.clear();
}

bool vmm::load_driver_api() {
  // Error names are optional: messages fall back to the numeric CUresult without them.
  load(api_.get_error_name, "cuGetErrorName");
  load(api_.get_error_string, "cuGetErrorString");
  struct entry {
    bool ok;
    const char* symbol;
  };
  const entry entries[] = {
      {load(api_.device_get, "cuDeviceGet"), "cuDeviceGet"},
      {load(api_.device_get_attribute, "cuDeviceGetAttribute"), "cuDeviceGetAttribute"},
      {load(api_.get_granularity, "cuMemGetAllocationGranularity"), "cuMemGetAllocationGranularity"},
      {load(api_.address_reserve, "cuMemAddressReserve"), "cuMemAddressReserve"},
      {load(api_.address_free, "cuMemAddressFree"), "cuMemAddressFree"},
      {load(api_.create, "cuMemCreate"), "cuMemCreate"},
      {load(api_.release, "cuMemRelease"), "cuMemRelease"},
      {load(api_.map, "cuMemMap"), "cuMemMap"},
      {load(api_.unmap, "cuMemUnmap"), "cuMemUnmap"},
      {load(api_.set_access, "cuMemSetAccess"), "cuMemSetAccess"},
  };
  for (const entry& e : entries) {
    if (!e.ok) {
      unavailable_reason_ = std::string("the driver has no entry point ") + e.symbol;
      return false;
    }
  }
  return true;
}

void vmm::query_granularity() {
  CUdevice dev = 0;
  int supported = 0;
  if (api_.device_get(&dev, device_) != CUDA_SUCCESS ||
      api_.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                dev) != CUDA_SUCCESS) {
    unavailable_reason_ = "cannot query CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED";
    return;
  }
  if (!supported) {
    unavailable_reason_ = "the device does not support virtual memory management";
    return;
  }
  std::size_t granularity = 0;
  if (api_.get_granularity(&granularity, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
      granularity == 0) {
    unavailable_reason_ = "cuMemGetAllocationGranularity failed";
    return;
  }
  granularity_ = granularity;
}

void* vmm::reserve(std::size_t bytes) {
  require_vmm("reserve_address_range");
  check_aligned("reserve_address_range", nullptr, bytes);
  CUdeviceptr base = 0;
  CUresult res = api_.address_reserve(&base, bytes, granularity_, 0, 0);
  if (res == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  if (res != CUDA_SUCCESS) throw_driver_error(res, "cuMemAddressReserve(" + format_bytes(bytes) + ")");
  try {
    std::lock_guard lock(mutex_);
    ranges_.insert(static_cast<std::uintptr_t>(base));
  } catch (...) {
    (void)api_.address_free(base, bytes);
    throw;
  }
  return reinterpret_cast<void*>(base);
}

void vmm::release(void* base, std::size_t bytes) noexcept {
  if (granularity_ == 0 || base == nullptr) return;
  unmap(base, bytes);
  {
    std::lock_guard lock(mutex_);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(base));  // allocates nothing
  }
  (void)api_.address_free(reinterpret_cast<CUdeviceptr>(base), bytes);
}

bool vmm::map(void* addr, std::size_t bytes) {
  require_vmm("map_physical");
  check_aligned("map_physical", addr, bytes);
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const auto end = begin + bytes;
  {
    std::lock_guard lock(mutex_);
    auto it = pages_.lower_bound(begin);
    if (it != pages_.end() && it->first < end)
      throw invalid_argument("map_physical(" + range_text(addr, bytes) + ") on cuda:" +
                             std::to_string(device_) + ": page " +
                             range_text(reinterpret_cast<void*>(it->first), granularity_) +
                             " is already mapped");
  }

  page_list mapped;
  mapped.reserve(bytes / granularity_);
  // On failure: undo this call's pages, then report lack of memory as false, anything else as
  // an exception.
  auto fail = [&](CUresult res, const std::string& call) {
    unmap_pages(mapped);
    if (res == CUDA_ERROR_OUT_OF_MEMORY) return false;
    throw_driver_error(res, call);
  };
  for (std::uintptr_t page = begin; page < end; page += granularity_) {
    CUmemGenericAllocationHandle handle = 0;
    CUresult res = api_.create(&handle, granularity_, &prop_, 0);
    if (res != CUDA_SUCCESS) return fail(res, "cuMemCreate(" + format_bytes(granularity_) + ")");
    res = api_.map(static_cast<CUdeviceptr>(page), granularity_, 0, handle, 0);
    if (res != CUDA_SUCCESS) {
      (void)api_.release(handle);
      return fail(res, "cuMemMap(" + range_text(reinterpret_cast<void*>(page), granularity_) + ")");
    }
    mapped.emplace_back(page, handle);
  }
  // One access call for the whole range: it may span several allocations as long as all are
  // mapped. Under the lock, with the pages recorded in the same hold, so that a grant_access()
  // either sees these pages or is seen here.
  std::lock_guard lock(mutex_);
  CUresult res = api_.set_access(static_cast<CUdeviceptr>(begin), bytes, access_.data(), access_.size());
  if (res != CUDA_SUCCESS) return fail(res, "cuMemSetAccess(" + range_text(addr, bytes) + ")");
  try {
    pages_.insert(mapped.begin(), mapped.end());
  } catch (...) {  // no host memory for the records: mapped pages nobody tracks would leak
    for (const auto& [page, handle] : mapped) pages_.erase(page);  // erasing allocates nothing
    unmap_pages(mapped);
    throw;
  }
  return true;
}

void vmm::grant_access(int peer) {
  require_vmm("grant_access");
  if (peer < 0) {
    throw invalid_argument("grant_access(" + std::to_string(peer) + ") on cuda:" +
                           std::to_string(device_) + ": expected a device index >= 0");
  }
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = peer;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::lock_guard lock(mutex_);
  for (const CUmemAccessDesc& d : access_) {
    if (d.location.id == peer) return;  // this device, or a peer granted before
  }
  // The peer first, so that every page mapped from now on is granted whatever happens below (as
  // PyTorch's expandable segments add the peer before setting access).
  access_.push_back(desc);
  // The pages mapped now, run by run of consecutive pages of one reserved range (a call may span
  // the allocations of a range, not two ranges); every run is tried, the first failure reported.
  CUresult first_failure = CUDA_SUCCESS;
  std::string failed_call;
  for (auto it = pages_.begin(); it != pages_.end();) {
    const std::uintptr_t begin = it->first;
    std::uintptr_t end = begin + granularity_;
    for (++it; it != pages_.end() && it->first == end && !ranges_.contains(end); ++it) end += granularity_;
    const CUresult res = api_.set_access(static_cast<CUdeviceptr>(begin), end - begin, &desc, 1);
    if (res != CUDA_SUCCESS && first_failure == CUDA_SUCCESS) {
      first_failure = res;
      failed_call = "cuMemSetAccess(" + range_text(reinterpret_cast<void*>(begin), end - begin) +
                    ") for cuda:" + std::to_string(peer);
    }
  }
  if (first_failure != CUDA_SUCCESS) throw_driver_error(first_failure, failed_call);
}

// noexcept, so it allocates nothing: the pages are unmapped where the map holds them (under the
// lock: release paths only), then their records erased.
void vmm::unmap(void* addr, std::size_t bytes) noexcept {
  if (granularity_ == 0 || addr == nullptr) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  std::lock_guard lock(mutex_);
  const auto first = pages_.lower_bound(begin);
  const auto last = pages_.lower_bound(begin + bytes);
  unmap_pages(std::ranges::subrange(first, last));
  pages_.erase(first, last);
}


void vmm::require_vmm(const char* call) const {
  if (granularity_ == 0)
    throw std::logic_error(std::string(call) + " on cuda:" + std::to_string(device_) +
                           ": VMM is not available (" + unavailable_reason_ +
                           "); check vmm_granularity() first");
}

void vmm::check_aligned(const char* call, const void* addr, std::size_t bytes) const {
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  if (bytes == 0 || bytes % granularity_ != 0 || a % granularity_ != 0)
    throw invalid_argument(std::string(call) + "(" + range_text(addr, bytes) + ") on cuda:" +
                           std::to_string(device_) + ": address and size must be non-zero multiples"
                           " of the granularity " + format_bytes(granularity_));
}

void vmm::throw_driver_error(CUresult res, const std::string& call) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_.get_error_name) (void)api_.get_error_name(res, &name);
  if (api_.get_error_string) (void)api_.get_error_string(res, &text);
  std::string what = call + " on cuda:" + std::to_string(device_) + " failed: ";
  what += name ? name : "CUresult " + std::to_string(static_cast<int>(res));
  if (text) what += std::string(": ") + text;
  throw device_error(what);
}

}  // namespace spillway::cuda
