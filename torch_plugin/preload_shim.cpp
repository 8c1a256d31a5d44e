// preload_shim.cpp: libspillway_preload.so's CUDA interposers. With
//   LD_PRELOAD=libspillway_preload.so SPILLWAY_CONF=budget:8GiB ./program
// the program's cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync (and their per-thread-stream
// variants) and cudaMemGetInfo come here. docs/integration.md is the user guide.
//
// Contract
// - Allocations come from spillway's process allocator (process_instance.hpp): cudaMalloc's on
//   the current device, cudaMallocAsync's on the stream's device (the runtime's own while the
//   stream is being captured: Note [Preload streams]); out of memory within the budget is cudaErrorMemoryAllocation, a bad argument
//   cudaErrorInvalidValue, an invalid SPILLWAY_CONF cudaErrorInitializationError (and the message,
//   once, on stderr). Every failure's message is in spillway_last_error().
// - A free of memory spillway does not hold (allocated before the shim was loaded, by
//   cudaMallocManaged, by another allocator) goes to the real function. A free of memory spillway
//   holds but that is not a live allocation (a double free) is reported and answered
//   cudaErrorInvalidValue; it never reaches the real cudaFree, which could free a whole segment.
// - cudaFree synchronises the device before the block returns to spillway's cache, as the real
//   cudaFree does; cudaFreeAsync does not (the free is ordered on its stream), except on the
//   per-thread default stream, which it synchronises (Note [Preload streams]).
// - Errors are returned, not left for cudaGetLastError: a program that checks only
//   cudaGetLastError after cudaMalloc misses spillway's (spillway_last_error() has the message).
// - cudaDeviceReset is not interposed: spillway's cached memory on that device is gone after it,
//   so a program must not allocate through spillway after resetting a device.
// - cudaMemGetInfo reports spillway_mem_get_info: the budget as the total.
// - A call made while spillway itself is running on this thread (its CUDA backend reserving a
//   segment) goes straight to the real function: Note [Preload re-entrancy].
//
// Note [Preload streams]
// spillway pools memory per stream. cudaMalloc's memory lives in a pool of its own (stream_ref 0),
// which only ever holds idle memory: cudaFree synchronises first, and a cudaFreeAsync of it waits
// for an event on the freeing stream. cudaMallocAsync on the legacy default stream (NULL) uses
// cudaStreamLegacy's pool instead, so the two never share blocks: a block freed on the legacy
// stream may still be in use by queued work, and cudaMalloc's callers may use its memory on any
// stream at once. A cudaFreeAsync on a stream other than the block's records that stream
// (record_stream): the block is reused only after the work queued there before the free is done.
// cudaStreamPerThread (and NULL for the _ptsz variants) is one handle for a different stream in
// each thread, and one pool: a block freed on it by one thread could go at once to another thread,
// whose stream nothing orders after the free. So a cudaFreeAsync on it synchronises the calling
// thread's stream first (a host wait per such free: correct before fast).
// cudaMallocAsync serves the stream's device (cudaStreamGetDevice), as the runtime's pools do, not
// the current one. On a stream being captured into a CUDA graph it is the real function's: the
// graph records an allocation node of its own, and the pointer, foreign to spillway, is freed by
// the real functions too. spillway's own memory cannot be freed inside a capture (the graph
// cannot free it, and giving it back to the pool at once would hand it out while every replay
// still writes it): such a cudaFreeAsync fails with cudaErrorStreamCaptureUnsupported and the
// memory stays live.
// With backend sim every stream is the simulated device's default stream: the simulated device
// cannot see the program's streams.
#include <cuda_runtime_api.h>
#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <exception>

#include "process_instance.hpp"
#include "real_cudart.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

// Declared by cuda_runtime_api.h only when a program is built for per-thread default streams.
extern "C" cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream);
extern "C" cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t stream);

namespace {

using spillway::plugin::entry_scope;
using spillway::plugin::set_last_error;
using spillway::preload::real;

constexpr spillway::stream_ref sync_pool{0};  // cudaMalloc's memory: Note [Preload streams]

// Note [Preload and fork]: a child forked after spillway made its CUDA allocator inherits memory
// and a CUDA context it cannot use (CUDA does not survive fork). Its allocations would hand out
// the parent's cached pointers with cudaSuccess. So in such a child every call goes to the real
// runtime, which fails as CUDA does there. A child forked before (a launcher's workers) and any
// child with backend sim keep spillway.
std::atomic<bool> forked_with_cuda_state{false};

[[gnu::constructor]] void watch_forks() {
  pthread_atfork(nullptr, nullptr, [] {
    if (spillway::plugin::holds_cuda_state()) forked_with_cuda_state.store(true);
  });
}

// A call that goes straight to the real function: made from inside spillway (Note [Preload
// re-entrancy]), or in a child forked with CUDA state (Note [Preload and fork]).
bool passthrough() noexcept {
  return entry_scope::active() || forked_with_cuda_state.load(std::memory_order_relaxed);
}

// Calls a real runtime function; cudaErrorNotSupported when the runtime does not have it.
template <class... Params, class... Args>
cudaError_t call_real(cudaError_t (*fn)(Params...), Args... args) {
  return fn != nullptr ? fn(args...) : cudaErrorNotSupported;
}

// The process allocator, or nullptr when SPILLWAY_CONF or the backend is bad (said once on stderr).
spillway::plugin_allocator* allocator() noexcept {
  static std::atomic<bool> said{false};
  try {
    return &spillway::plugin::process_allocator();
  } catch (const std::exception& e) {
    set_last_error(e.what());
    if (!said.exchange(true)) {
      std::fprintf(stderr, "%s\nspillway: the preload shim is not working: allocations fail with "
                           "cudaErrorInitializationError until this is fixed\n", e.what());
    }
  }
  return nullptr;
}

// The pool of a stream-ordered allocation. `null_stream` is what a NULL stream means to the caller:
// cudaStreamLegacy, or cudaStreamPerThread for the _ptsz variants.
spillway::stream_ref async_pool(const spillway::plugin_allocator& a, cudaStream_t stream,
                                cudaStream_t null_stream) noexcept {
  if (a.config().backend == "sim") return sync_pool;
  return spillway::stream_ref{reinterpret_cast<std::uintptr_t>(stream != nullptr ? stream : null_stream)};
}

cudaError_t failed(const std::exception& e, cudaError_t code) noexcept {
  set_last_error(e.what());
  return code;
}

// A failure of the device: the runtime's own code when the backend's error carries one (a fault
// the device reported stays that fault), else cudaErrorUnknown.
cudaError_t device_failed(const std::exception& e) noexcept {
  const auto* d = dynamic_cast<const spillway::device_error*>(&e);
  return failed(e, d != nullptr && d->code() != 0 ? static_cast<cudaError_t>(d->code()) : cudaErrorUnknown);
}

// Whether work queued on `stream` (0: `null_stream`) now goes into a graph being captured, or the
// runtime's error when it cannot say (then the real function gives the caller that error).
cudaError_t capture_status(cudaStream_t stream, cudaStream_t null_stream, bool& capturing) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream != nullptr ? stream : null_stream, &status);
  capturing = err == cudaSuccess && status != cudaStreamCaptureStatusNone;
  return err;
}

// cudaMalloc (async: false) or cudaMallocAsync on `stream`. Stream-ordered memory comes from the
// stream's device, as the runtime's pools give it; a stream being captured gets the real
// function, so that the graph records its own allocation (Note [Preload streams]).
cudaError_t allocate(void** ptr, size_t size, bool async, cudaStream_t stream, cudaStream_t null_stream,
                     cudaError_t (*real_async)(void**, size_t, cudaStream_t)) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  if (async) {
    bool capturing = false;
    if (capture_status(stream, null_stream, capturing) != cudaSuccess || capturing) {
      return call_real(real_async, ptr, size, stream);
    }
  }
  spillway::plugin_allocator* a = allocator();
  if (a == nullptr) return cudaErrorInitializationError;
  try {
    int device = 0;
    const cudaError_t err = async ? cudaStreamGetDevice(stream != nullptr ? stream : null_stream, &device)
                                  : cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const spillway::stream_ref pool = async ? async_pool(*a, stream, null_stream) : sync_pool;
    *ptr = a->allocate(device, size, pool);
    return cudaSuccess;
  } catch (const spillway::out_of_memory& e) {
    return failed(e, cudaErrorMemoryAllocation);
  } catch (const spillway::invalid_argument& e) {
    // Over what any device could hold is out of memory, as the runtime has it.
    return failed(e, size > spillway::size_classes::max_request_size ? cudaErrorMemoryAllocation
                                                                     : cudaErrorInvalidValue);
  } catch (const std::exception& e) {
    return device_failed(e);
  }
}

// The device whose memory holds ptr, or nullptr for foreign memory (and when there is no allocator:
// then no memory is spillway's).
spillway::device_allocator* holder(spillway::plugin_allocator* a, const void* ptr) noexcept {
  if (a == nullptr || ptr == nullptr) return nullptr;
  spillway::device_allocator* d = a->owner_of(ptr);
  return d != nullptr ? d : a->holder_of(ptr);
}

cudaError_t release(spillway::plugin_allocator& a, void* ptr) noexcept {
  switch (a.deallocate(ptr)) {
    case spillway::free_result::freed:
    case spillway::free_result::deferred: return cudaSuccess;
    case spillway::free_result::invalid:  // reported by the device allocator
    case spillway::free_result::foreign: break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t free_async(void* ptr, cudaStream_t stream, cudaStream_t null_stream,
                       cudaError_t (*real_fn)(void*, cudaStream_t)) {
  spillway::plugin_allocator* a = allocator();
  spillway::device_allocator* d = holder(a, ptr);
  if (d == nullptr) return call_real(real_fn, ptr, stream);
  bool capturing = false;
  if (cudaError_t err = capture_status(stream, null_stream, capturing); err != cudaSuccess) return err;
  if (capturing) {
    // A graph can free only what it allocated: spillway's memory would go back to its pool now,
    // while every replay of the graph still writes it. Refused; the memory stays live.
    set_last_error("spillway: cudaFreeAsync(" + spillway::format_pointer(ptr) +
                   ") on a stream being captured into a graph: the memory is spillway's, not the "
                   "graph's, and cannot be freed by it; free it outside the capture");
    return cudaErrorStreamCaptureUnsupported;
  }
  const spillway::stream_ref pool = async_pool(*a, stream, null_stream);
  if (pool == spillway::stream_ref{reinterpret_cast<std::uintptr_t>(cudaStreamPerThread)}) {
    // One handle names every thread's own stream (Note [Preload streams]): its pool can hand the
    // block to another thread's stream, which nothing orders after this free. So the work this
    // thread queued before the free is waited for first; if that fails, the block is kept.
    if (cudaError_t err = cudaStreamSynchronize(cudaStreamPerThread); err != cudaSuccess) return err;
  }
  try {
    if (d->owns(ptr)) d->record_stream(ptr, pool);
  } catch (const std::exception& e) {
    set_last_error(e.what());  // freed meanwhile by another thread: release() reports it
  }
  return release(*a, ptr);
}

}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (passthrough()) return call_real(real().malloc, ptr, size);  // Note [Preload re-entrancy]
  entry_scope scope;
  return allocate(ptr, size, false, nullptr, nullptr, nullptr);
}

cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (passthrough()) return call_real(real().malloc_async, ptr, size, stream);
  entry_scope scope;
  return allocate(ptr, size, true, stream, cudaStreamLegacy, real().malloc_async);
}

cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream) {
  if (passthrough()) return call_real(real().malloc_async_ptsz, ptr, size, stream);
  entry_scope scope;
  return allocate(ptr, size, true, stream, cudaStreamPerThread, real().malloc_async_ptsz);
}

cudaError_t cudaFree(void* ptr) {
  if (passthrough()) return call_real(real().free, ptr);
  entry_scope scope;
  // cudaFree(NULL) is how programs make the runtime set up its context: the real one does that.
  spillway::plugin_allocator* a = ptr != nullptr ? allocator() : nullptr;
  spillway::device_allocator* d = holder(a, ptr);
  if (d == nullptr) return call_real(real().free, ptr);
  cudaError_t sync = cudaSuccess;
  try {
    d->backend().synchronize_device();  // what the real cudaFree does: Note [Preload streams]
  } catch (const std::exception& e) {
    sync = device_failed(e);
  }
  const cudaError_t freed = release(*a, ptr);
  return freed != cudaSuccess ? freed : sync;
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (passthrough()) return call_real(real().free_async, ptr, stream);
  entry_scope scope;
  return free_async(ptr, stream, cudaStreamLegacy, real().free_async);
}

cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t stream) {
  if (passthrough()) return call_real(real().free_async_ptsz, ptr, stream);
  entry_scope scope;
  return free_async(ptr, stream, cudaStreamPerThread, real().free_async_ptsz);
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (passthrough()) return call_real(real().mem_get_info, free_bytes, total_bytes);
  entry_scope scope;
  if (free_bytes == nullptr || total_bytes == nullptr) return cudaErrorInvalidValue;
  spillway::plugin_allocator* a = allocator();
  if (a == nullptr) return call_real(real().mem_get_info, free_bytes, total_bytes);
  try {
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    const spillway::memory_info info = a->memory_info_of(device);
    *free_bytes = info.free;
    *total_bytes = info.total;
    return cudaSuccess;
  } catch (const spillway::invalid_argument& e) {
    return failed(e, cudaErrorInvalidValue);
  } catch (const std::exception& e) {
    return device_failed(e);
  }
}

}  // extern "C"
