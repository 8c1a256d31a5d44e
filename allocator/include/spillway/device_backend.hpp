// device_backend: the small interface between spillway's allocator and a device.
//
// Contract
// - One backend object stands for one device. Every method is thread-safe.
// - Memory calls report "no memory" as an expected event: reserve_segment and map_physical
//   return nullptr / false and never throw for lack of memory. Other failures (an injected copy
//   fault, a driver error) throw spillway::device_error.
// - Work is stream ordered. copy_async and record_event enqueue; they return before the work runs.
//   An event is complete once all work enqueued on its stream before record_event has run.
// - Handles are opaque integers: for the CUDA backend they are cudaStream_t / cudaEvent_t values,
//   for the simulated device they are indices. stream_ref{} (0) is the device's default stream.
// - release_* / destroy_* / unmap_physical are noexcept: they are called on paths that must not fail.
//
// Two backends implement it: cuda_device (cuda_device.hpp) and sim_device (sim_device.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace spillway {

// A non-owning reference to a stream of one device. Value 0 is the default stream.
struct stream_ref {
  std::uintptr_t value = 0;

  friend constexpr bool operator==(stream_ref a, stream_ref b) noexcept { return a.value == b.value; }
  friend constexpr bool operator!=(stream_ref a, stream_ref b) noexcept { return a.value != b.value; }
  friend constexpr bool operator<(stream_ref a, stream_ref b) noexcept { return a.value < b.value; }
};

// A non-owning reference to an event of one device. Value 0 is never a valid event.
struct event_ref {
  std::uintptr_t value = 0;

  friend constexpr bool operator==(event_ref a, event_ref b) noexcept { return a.value == b.value; }
  friend constexpr bool operator!=(event_ref a, event_ref b) noexcept { return a.value != b.value; }
};

enum class copy_kind { host_to_device, device_to_host, device_to_device, host_to_host };

class device_backend {
 public:
  virtual ~device_backend() = default;

  // --- identity -------------------------------------------------------------------------------
  virtual int device_index() const noexcept = 0;
  virtual std::string name() const = 0;            // "sim:0", "cuda:0 (NVIDIA H100 ...)"
  virtual std::size_t total_memory() const = 0;    // physical capacity of the device in bytes
  virtual std::size_t free_memory() const = 0;     // what the device could still hand out now

  // --- plain segments (cudaMalloc / cudaFree) -------------------------------------------------
  // Returns nullptr when the device has no memory for it. The pointer is 512-byte aligned.
  virtual void* reserve_segment(std::size_t bytes) = 0;
  virtual void release_segment(void* ptr, std::size_t bytes) noexcept = 0;

  // Waits for all work queued on every stream of the device (cudaDeviceSynchronize). The allocator
  // calls it once before it releases cached segments or unmaps pages that queued work may still
  // touch (Note [Releasing memory to the device]).
  virtual void synchronize_device() = 0;

  // --- virtual memory (expandable segments) ---------------------------------------------------
  // vmm_granularity() == 0 means the backend has no VMM; the other VMM calls must not be used then.
  // An address range is reserved once; physical pages are mapped into and unmapped from it in
  // multiples of the granularity. map_physical returns false when the device has no memory.
  virtual std::size_t vmm_granularity() const noexcept = 0;
  virtual void* reserve_address_range(std::size_t bytes) = 0;  // nullptr when out of address space
  virtual void release_address_range(void* base, std::size_t bytes) noexcept = 0;
  virtual bool map_physical(void* addr, std::size_t bytes) = 0;
  virtual void unmap_physical(void* addr, std::size_t bytes) noexcept = 0;
  // Lets device `peer` reach the pages mapped now and every page mapped from then on (PyTorch's
  // enablePeerAccess for expandable segments; plain segments need only the runtime's peer access,
  // which is the caller's). The default does nothing: a backend without VMM or without peers.
  virtual void grant_vmm_access(int peer) { (void)peer; }

  // --- streams --------------------------------------------------------------------------------
  virtual stream_ref create_stream() = 0;
  virtual void destroy_stream(stream_ref s) noexcept = 0;
  virtual void synchronize_stream(stream_ref s) = 0;

  // --- events ---------------------------------------------------------------------------------
  virtual event_ref create_event() = 0;
  virtual void destroy_event(event_ref e) noexcept = 0;
  virtual void record_event(event_ref e, stream_ref s) = 0;
  virtual bool event_completed(event_ref e) = 0;         // a non-blocking query
  virtual void synchronize_event(event_ref e) = 0;       // blocks (or advances the simulation)
  virtual void stream_wait_event(stream_ref s, event_ref e) = 0;

  // --- copies ---------------------------------------------------------------------------------
  // Enqueues a copy of `bytes` on stream `s`. Host memory must come from allocate_pinned_host
  // for the copy to be asynchronous on a real device.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                          stream_ref s) = 0;

  // --- pinned host memory ---------------------------------------------------------------------
  // Returns nullptr when no pinned memory is available.
  virtual void* allocate_pinned_host(std::size_t bytes) = 0;
  virtual void free_pinned_host(void* ptr, std::size_t bytes) noexcept = 0;
};

}  // namespace spillway
