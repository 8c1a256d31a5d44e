// fake_cudart.cpp: a CUDA runtime on host memory, for tests without a GPU. fake_cudart.h says what
// it implements. Built as libcudart.so.<major> with the real runtime's symbol version, so programs
// and libraries linked against the real one bind to it when it is found first.
#include "fake_cudart.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace {

struct allocation {
  std::size_t bytes = 0;
  bool managed = false;
};

struct state {
  std::mutex mutex;
  std::unordered_map<void*, allocation> allocations;
  std::unordered_set<std::uintptr_t> streams;
  std::unordered_set<std::uintptr_t> events;
  std::unordered_set<std::uintptr_t> capturing;  // streams fake_cudart_set_capturing marked
  cudaError_t next_sync_error = cudaSuccess;     // fake_cudart_fail_next_device_sync
  std::uintptr_t next_handle = 0x1000;  // above cudaStreamLegacy / cudaStreamPerThread
  fake_cudart_counters counters{};
};

state& the_state() {
  static state* s = new state;  // never destroyed: programs call the runtime from destructors
  return *s;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

cudaError_t fail(cudaError_t err) {
  last_error = err;
  return err;
}

std::size_t rounded(std::size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

cudaError_t device_malloc(void** ptr, std::size_t bytes, std::uint64_t fake_cudart_counters::*counter) {
  if (ptr == nullptr) return fail(cudaErrorInvalidValue);
  if (bytes == 0) {
    *ptr = nullptr;
    return cudaSuccess;
  }
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  if (rounded(bytes) > FAKE_CUDART_CAPACITY - s.counters.bytes_in_use) {
    ++s.counters.failed_mallocs;
    return fail(cudaErrorMemoryAllocation);
  }
  void* p = std::aligned_alloc(4096, rounded(bytes));
  if (p == nullptr) return fail(cudaErrorMemoryAllocation);
  s.allocations[p] = {rounded(bytes), false};
  s.counters.bytes_in_use += rounded(bytes);
  ++(s.counters.*counter);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t device_free(void* ptr, std::uint64_t fake_cudart_counters::*counter) {
  if (ptr == nullptr) return cudaSuccess;
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  const auto it = s.allocations.find(ptr);
  if (it == s.allocations.end()) {
    ++s.counters.invalid_frees;
    return fail(cudaErrorInvalidValue);
  }
  if (!it->second.managed) s.counters.bytes_in_use -= it->second.bytes;
  std::free(it->first);
  s.allocations.erase(it);
  ++(s.counters.*counter);
  return cudaSuccess;
}

template <class Handle>
cudaError_t create_handle(Handle* out, std::unordered_set<std::uintptr_t> state::*set) {
  if (out == nullptr) return fail(cudaErrorInvalidValue);
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  const std::uintptr_t h = s.next_handle++;
  (s.*set).insert(h);
  *out = reinterpret_cast<Handle>(h);
  return cudaSuccess;
}

cudaError_t destroy_handle(std::uintptr_t h, std::unordered_set<std::uintptr_t> state::*set) {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  if ((s.*set).erase(h) == 0) return fail(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}

// NULL, cudaStreamLegacy, cudaStreamPerThread and created streams are valid.
cudaError_t check_stream(cudaStream_t stream) {
  const auto h = reinterpret_cast<std::uintptr_t>(stream);
  if (h <= 2) return cudaSuccess;
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  return s.streams.count(h) != 0 ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

cudaError_t check_event(cudaEvent_t event) {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  return s.events.count(reinterpret_cast<std::uintptr_t>(event)) != 0 ? cudaSuccess
                                                                      : fail(cudaErrorInvalidResourceHandle);
}

}  // namespace

extern "C" {

fake_cudart_counters fake_cudart_get_counters(void) {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  return s.counters;
}

void fake_cudart_fail_next_device_sync(cudaError_t error) {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  s.next_sync_error = error;
}

void fake_cudart_set_capturing(cudaStream_t stream, int capturing) {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  if (capturing) {
    s.capturing.insert(reinterpret_cast<std::uintptr_t>(stream));
  } else {
    s.capturing.erase(reinterpret_cast<std::uintptr_t>(stream));
  }
}

// --- errors -----------------------------------------------------------------------------------
cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error; }

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    default: return "unknown error";
  }
}

// --- devices ----------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return fail(cudaErrorInvalidValue);
  if (device != 0) return fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof *prop);
  std::strncpy(prop->name, "spillway fake CUDA device", sizeof prop->name - 1);
  prop->totalGlobalMem = FAKE_CUDART_CAPACITY;
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  const cudaError_t err = std::exchange(s.next_sync_error, cudaSuccess);
  return err == cudaSuccess ? cudaSuccess : fail(err);
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return fail(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return fail(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                             enum cudaDriverEntryPointQueryResult* status) {
  if (symbol == nullptr || fn == nullptr) return fail(cudaErrorInvalidValue);
  *fn = nullptr;  // no driver: no VMM
  if (status != nullptr) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

// --- memory -----------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** ptr, size_t size) {
  return device_malloc(ptr, size, &fake_cudart_counters::mallocs);
}

cudaError_t cudaFree(void* ptr) { return device_free(ptr, &fake_cudart_counters::frees); }

cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  return device_malloc(ptr, size, &fake_cudart_counters::async_mallocs);
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  return device_free(ptr, &fake_cudart_counters::async_frees);
}

cudaError_t cudaMallocManaged(void** ptr, size_t size, unsigned int) {
  if (ptr == nullptr || size == 0) return fail(cudaErrorInvalidValue);
  void* p = std::aligned_alloc(4096, rounded(size));
  if (p == nullptr) return fail(cudaErrorMemoryAllocation);
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  s.allocations[p] = {rounded(size), true};
  ++s.counters.managed_mallocs;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) return fail(cudaErrorInvalidValue);
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  *free_bytes = FAKE_CUDART_CAPACITY - s.counters.bytes_in_use;
  *total_bytes = FAKE_CUDART_CAPACITY;
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
  if (ptr == nullptr || size == 0) return fail(cudaErrorInvalidValue);
  *ptr = std::malloc(size);
  return *ptr != nullptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind) {
  if (count != 0 && (dst == nullptr || src == nullptr)) return fail(cudaErrorInvalidValue);
  if (count != 0) std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  return cudaMemcpy(dst, src, count, kind);
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  if (count != 0 && ptr == nullptr) return fail(cudaErrorInvalidValue);
  if (count != 0) std::memset(ptr, value, count);
  return cudaSuccess;
}

// --- streams and events -------------------------------------------------------------------------
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return create_handle(stream, &state::streams);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  return create_handle(stream, &state::streams);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  return destroy_handle(reinterpret_cast<std::uintptr_t>(stream), &state::streams);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (stream == cudaStreamPerThread) {
    state& s = the_state();
    std::lock_guard lock(s.mutex);
    ++s.counters.per_thread_syncs;
  }
  return check_stream(stream);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  if (status == nullptr) return fail(cudaErrorInvalidValue);
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  *status = s.capturing.count(reinterpret_cast<std::uintptr_t>(stream)) != 0 ? cudaStreamCaptureStatusActive
                                                                          : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  *device = 0;  // the one device
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  return check_event(event);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return create_handle(event, &state::events);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  return destroy_handle(reinterpret_cast<std::uintptr_t>(event), &state::events);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (cudaError_t e = check_stream(stream); e != cudaSuccess) return e;
  return check_event(event);
}

cudaError_t cudaEventQuery(cudaEvent_t event) { return check_event(event); }

cudaError_t cudaEventSynchronize(cudaEvent_t event) { return check_event(event); }

}  // extern "C"
