// alloc_peers.cpp: cudaMalloc, cudaMallocAsync and CUB's CachingDeviceAllocator on the cases of
// spillway-alloc-bench. See alloc_peers.hpp. CUB's allocator is host code: this file is compiled
// by the C++ compiler with the CCCL include directory (SPILLWAY_HAVE_CUB), no nvcc needed.
#include "alloc_peers.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "spillway/errors.hpp"

#ifdef SPILLWAY_HAVE_CUB
#include <cub/util_allocator.cuh>
#endif

namespace spillway::bench {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw device_error(std::string("spillway-alloc-bench: ") + what + " failed: " +
                       cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")");
  }
}

cudaStream_t to_cuda(stream_ref s) noexcept {
  return s.value == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(s.value);
}

// Per-thread event for the cross-stream frees (only cross_stream_case uses it, on one thread).
class order_after {
 public:
  order_after() { check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"); }
  ~order_after() { cudaEventDestroy(event_); }
  order_after(const order_after&) = delete;
  order_after& operator=(const order_after&) = delete;
  // Makes `s` wait for what is queued on `other` now.
  void operator()(stream_ref s, stream_ref other) {
    check(cudaEventRecord(event_, to_cuda(other)), "cudaEventRecord");
    check(cudaStreamWaitEvent(to_cuda(s), event_, 0), "cudaStreamWaitEvent");
  }

 private:
  cudaEvent_t event_ = nullptr;
};

class cuda_malloc_subject {
 public:
  explicit cuda_malloc_subject(int device) : device_(device) {}
  std::string name() const { return "cudaMalloc"; }
  void thread_init() { check(cudaSetDevice(device_), "cudaSetDevice"); }
  void* allocate(std::size_t bytes, stream_ref) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  void deallocate(void* p, stream_ref) { check(cudaFree(p), "cudaFree"); }

 private:
  int device_;
};

class malloc_async_subject {
 public:
  explicit malloc_async_subject(int device) : device_(device) {
    thread_init();
    cudaMemPool_t pool = nullptr;
    check(cudaDeviceGetDefaultMemPool(&pool, device_), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep_all = UINT64_MAX;  // cache everything, as spillway does
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all),
          "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  std::string name() const { return "cudaMallocAsync"; }
  void thread_init() { check(cudaSetDevice(device_), "cudaSetDevice"); }
  void* allocate(std::size_t bytes, stream_ref s) {
    void* p = nullptr;
    check(cudaMallocAsync(&p, bytes, to_cuda(s)), "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p, stream_ref s) { check(cudaFreeAsync(p, to_cuda(s)), "cudaFreeAsync"); }
  void deallocate_after(void* p, stream_ref s, stream_ref other) {
    order_(s, other);
    deallocate(p, s);
  }

 private:
  int device_;
  order_after order_;
};

#ifdef SPILLWAY_HAVE_CUB
class cub_subject {
 public:
  explicit cub_subject(int device) : device_(device) {}
  std::string name() const { return "cub::CachingDeviceAllocator"; }
  void thread_init() { check(cudaSetDevice(device_), "cudaSetDevice"); }
  void* allocate(std::size_t bytes, stream_ref s) {
    void* p = nullptr;
    check(cub_.DeviceAllocate(&p, bytes, to_cuda(s)), "cub DeviceAllocate");
    return p;
  }
  void deallocate(void* p, stream_ref) { check(cub_.DeviceFree(p), "cub DeviceFree"); }
  void deallocate_after(void* p, stream_ref s, stream_ref other) {
    order_(s, other);
    deallocate(p, s);  // CUB records its ready event on s, which now waits for `other`
  }

 private:
  int device_;
  cub::CachingDeviceAllocator cub_;
  order_after order_;
};
#endif

}  // namespace

std::vector<case_result> run_cuda_peers(int device, stream_ref s1, stream_ref s2,
                                        const std::vector<stream_ref>& per_thread,
                                        const timing& t) {
  std::vector<case_result> results;
  check(cudaSetDevice(device), "cudaSetDevice");
  {
    cuda_malloc_subject a(device);
    results.push_back(cache_hit_case(a, s1, t));
    results.push_back(multi_thread_case(a, per_thread, t));
  }
  {
    malloc_async_subject a(device);
    results.push_back(cache_hit_case(a, s1, t));
    results.push_back(split_case(a, s1, t));
    results.push_back(cross_stream_case(a, s1, s2, t));
    results.push_back(multi_thread_case(a, per_thread, t));
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
#ifdef SPILLWAY_HAVE_CUB
  {
    cub_subject a(device);
    results.push_back(cache_hit_case(a, s1, t));
    results.push_back(cross_stream_case(a, s1, s2, t));
    results.push_back(multi_thread_case(a, per_thread, t));
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
#endif
  return results;
}

}  // namespace spillway::bench
