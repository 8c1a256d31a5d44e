// cuda_device.cpp: the device_backend of a real CUDA device.
//
// Runtime API (cudart_static) for segments, streams, events, copies and pinned memory; cuda_vmm
// for expandable segments. Every call runs under a device_guard for this device. Nothing here
// links libcuda: without a driver the runtime reports cudaErrorInsufficientDriver and
// cuda_device_count() is 0.
#include "spillway/cuda_device.hpp"

#include <cuda_runtime_api.h>

#include <memory>
#include <new>
#include <string>

#include "cuda_call.hpp"
#include "cuda_vmm.hpp"
#include "spillway/errors.hpp"

namespace spillway {
namespace {

using cuda::check_cuda;
using cuda::clear_error;
using cuda::device_guard;
using cuda::throw_cuda_error;

// stream_ref{} is the legacy default stream. Naming it explicitly keeps that meaning even if a
// translation unit is built with per-thread default streams.
cudaStream_t to_cuda(stream_ref s) noexcept {
  return s.value == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(s.value);
}

cudaEvent_t to_cuda(event_ref e) noexcept { return reinterpret_cast<cudaEvent_t>(e.value); }

cudaMemcpyKind to_cuda(copy_kind kind) noexcept {
  switch (kind) {
    case copy_kind::host_to_device: return cudaMemcpyHostToDevice;
    case copy_kind::device_to_host: return cudaMemcpyDeviceToHost;
    case copy_kind::device_to_device: return cudaMemcpyDeviceToDevice;
    case copy_kind::host_to_host: return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

const char* kind_name(copy_kind kind) noexcept {
  switch (kind) {
    case copy_kind::host_to_device: return "host_to_device";
    case copy_kind::device_to_host: return "device_to_host";
    case copy_kind::device_to_device: return "device_to_device";
    case copy_kind::host_to_host: return "host_to_host";
  }
  return "unknown";
}

std::string version_text(int version) {  // 12040 -> "12.4"
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

std::string sized(const char* call, std::size_t bytes) {
  return std::string(call) + "(" + format_bytes(bytes) + ")";
}

class cuda_device final : public device_backend {
 public:
  explicit cuda_device(int index) : index_(index) {
    device_guard guard(index_);  // also creates the primary context: failures surface here
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, index_), "cudaGetDeviceProperties", index_);
    name_ = "cuda:" + std::to_string(index_) + " (" + prop.name + ")";
    std::size_t free = 0;
    check_cuda(cudaMemGetInfo(&free, &total_), "cudaMemGetInfo", index_);
    vmm_ = std::make_unique<cuda::vmm>(index_);
  }

  ~cuda_device() override {
    device_guard guard(index_, std::nothrow);
    vmm_.reset();
  }

  // --- identity ---------------------------------------------------------------------------------
  int device_index() const noexcept override { return index_; }
  std::string name() const override { return name_; }
  std::size_t total_memory() const override { return total_; }

  std::size_t free_memory() const override {
    device_guard guard(index_);
    std::size_t free = 0, total = 0;
    check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", index_);
    return free;
  }

  // --- plain segments -----------------------------------------------------------------------------
  void* reserve_segment(std::size_t bytes) override {
    require_size("reserve_segment", bytes);
    device_guard guard(index_);
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err == cudaErrorMemoryAllocation) {
      clear_error(err);  // expected: the caller frees cache and retries; later calls must not see it
      return nullptr;
    }
    if (err != cudaSuccess) throw_cuda_error(err, sized("cudaMalloc", bytes), index_);
    return ptr;
  }

  void release_segment(void* ptr, std::size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    device_guard guard(index_, std::nothrow);
    // Errors are ignored: at exit the runtime may already be unloading (cudaErrorCudartUnloading).
    clear_error(cudaFree(ptr));
  }

  void synchronize_device() override {
    device_guard guard(index_);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", index_);
  }

  // --- virtual memory -----------------------------------------------------------------------------
  std::size_t vmm_granularity() const noexcept override { return vmm_->granularity(); }

  void* reserve_address_range(std::size_t bytes) override {
    device_guard guard(index_);
    return vmm_->reserve(bytes);
  }

  void release_address_range(void* base, std::size_t bytes) noexcept override {
    device_guard guard(index_, std::nothrow);
    vmm_->release(base, bytes);
  }

  bool map_physical(void* addr, std::size_t bytes) override {
    device_guard guard(index_);
    return vmm_->map(addr, bytes);
  }

  void unmap_physical(void* addr, std::size_t bytes) noexcept override {
    device_guard guard(index_, std::nothrow);
    vmm_->unmap(addr, bytes);
  }

  void grant_vmm_access(int peer) override {
    if (vmm_->granularity() == 0 || peer == index_) return;  // no VMM pages; its own pages
    device_guard guard(index_);
    vmm_->grant_access(peer);
  }

  // --- streams ------------------------------------------------------------------------------------
  stream_ref create_stream() override {
    device_guard guard(index_);
    cudaStream_t s = nullptr;
    // Non-blocking: the allocator's streams must not serialise with the legacy default stream.
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", index_);
    return stream_ref{reinterpret_cast<std::uintptr_t>(s)};
  }

  void destroy_stream(stream_ref s) noexcept override {
    if (s.value == 0) return;  // the default stream is not ours to destroy
    device_guard guard(index_, std::nothrow);
    clear_error(cudaStreamDestroy(to_cuda(s)));
  }

  void synchronize_stream(stream_ref s) override {
    device_guard guard(index_);
    check_cuda(cudaStreamSynchronize(to_cuda(s)), "cudaStreamSynchronize", index_);
  }

  // --- events -------------------------------------------------------------------------------------
  event_ref create_event() override {
    device_guard guard(index_);
    cudaEvent_t e = nullptr;
    // No timing: cheaper to record and query, and all the allocator asks is "has it passed?".
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags", index_);
    return event_ref{reinterpret_cast<std::uintptr_t>(e)};
  }

  void destroy_event(event_ref e) noexcept override {
    if (e.value == 0) return;
    device_guard guard(index_, std::nothrow);
    clear_error(cudaEventDestroy(to_cuda(e)));
  }

  void record_event(event_ref e, stream_ref s) override {
    device_guard guard(index_);
    check_cuda(cudaEventRecord(to_cuda(e), to_cuda(s)), "cudaEventRecord", index_);
  }

  bool event_completed(event_ref e) override {
    device_guard guard(index_);
    cudaError_t err = cudaEventQuery(to_cuda(e));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      clear_error(err);  // a status, not a failure; an older pending error is left to its owner
      return false;
    }
    throw_cuda_error(err, "cudaEventQuery", index_);
  }

  void synchronize_event(event_ref e) override {
    device_guard guard(index_);
    check_cuda(cudaEventSynchronize(to_cuda(e)), "cudaEventSynchronize", index_);
  }

  void stream_wait_event(stream_ref s, event_ref e) override {
    device_guard guard(index_);
    check_cuda(cudaStreamWaitEvent(to_cuda(s), to_cuda(e), 0), "cudaStreamWaitEvent", index_);
  }

  // --- copies -------------------------------------------------------------------------------------
  void copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind, stream_ref s) override {
    if (bytes == 0) return;
    device_guard guard(index_);
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), to_cuda(s));
    if (err != cudaSuccess)
      throw_cuda_error(err, "cudaMemcpyAsync(" + format_bytes(bytes) + ", " + kind_name(kind) + ")", index_);
  }

  // --- pinned host memory ---------------------------------------------------------------------------
  void* allocate_pinned_host(std::size_t bytes) override {
    require_size("allocate_pinned_host", bytes);
    device_guard guard(index_);
    void* ptr = nullptr;
    cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
    if (err == cudaErrorMemoryAllocation) {
      clear_error(err);
      return nullptr;
    }
    if (err != cudaSuccess) throw_cuda_error(err, sized("cudaHostAlloc", bytes), index_);
    return ptr;
  }

  void free_pinned_host(void* ptr, std::size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    device_guard guard(index_, std::nothrow);
    clear_error(cudaFreeHost(ptr));
  }

 private:
  // A zero size would come back as nullptr, which callers read as "out of memory".
  void require_size(const char* call, std::size_t bytes) const {
    if (bytes == 0)
      throw invalid_argument(std::string(call) + " on cuda:" + std::to_string(index_) +
                             ": size 0; expected at least 1 byte");
  }

  int index_;
  std::string name_;
  std::size_t total_ = 0;
  std::unique_ptr<cuda::vmm> vmm_;
};

}  // namespace

int cuda_device_count() noexcept {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    clear_error(err);
    return 0;
  }
  return count;
}

std::string cuda_unavailable_reason() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess) return count > 0 ? "" : "no CUDA-capable device (cudaGetDeviceCount found 0)";
  clear_error(err);
  const std::string text = cuda::cuda_error_text(err);
  switch (err) {
    case cudaErrorInsufficientDriver: {
      int driver = 0;
      clear_error(cudaDriverGetVersion(&driver));
      if (driver == 0) return "no CUDA driver (" + text + ")";
      return "the CUDA driver supports CUDA " + version_text(driver) + ", older than this runtime's " +
             version_text(CUDART_VERSION) + " (" + text + ")";
    }
    case cudaErrorNoDevice:
      return "no CUDA-capable device (" + text + ")";
    default:
      return "CUDA cannot be initialised (" + text + ")";
  }
}

std::shared_ptr<device_backend> make_cuda_device(int index) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count) {
    std::string what = "make_cuda_device: no CUDA device with index " + std::to_string(index) +
                       ": this process sees " + std::to_string(count) + " CUDA device(s)";
    what += count == 0 ? ": " + cuda_unavailable_reason()
                       : "; valid indices are 0.." + std::to_string(count - 1);
    throw invalid_argument(what);
  }
  return std::make_shared<cuda_device>(index);
}

}  // namespace spillway
