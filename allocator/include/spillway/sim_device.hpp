// sim_device: a simulated GPU that behaves like one in the ways an allocator can observe.
//
// It is a product feature, not a test mock: trace replay, the stress benchmark and the eviction
// simulator run on it. See Note [Simulated device] in docs/design.md.
//
// What it models
// - Fixed capacity. Every segment and mapped page is real host memory (mmap'd, MAP_NORESERVE, so
//   untouched bytes cost nothing), so data written through a device pointer can be read back and
//   checksummed. Reservations beyond the capacity fail (nullptr / false), like cudaMalloc.
// - VMM: reserve_address_range / map_physical / unmap_physical at `vmm_granularity` (2 MiB by
//   default). Unmapped pages are PROT_NONE: touching them faults, like on a GPU.
// - Streams and events on a virtual clock (nanoseconds). Work enqueued on a stream (copies,
//   launch()ed kernels, event records, waits on events) runs in FIFO order per stream; its effects
//   (the bytes a copy moves, the callback a kernel runs) happen when the op completes, not when it
//   is enqueued. Work completes only when the clock reaches its end time:
//     clock_mode::manual    the clock moves only through advance(), run_until_idle() and the
//                           blocking calls (synchronize_*), which run the simulation up to the
//                           point they wait for;
//     clock_mode::realtime  the clock follows the wall clock since construction (scaled by
//                           time_scale), so work completes "later" by itself; used by the stress
//                           benchmark.
//   A held stream (hold(s)) runs nothing until release(s): tests use it to prove that the allocator
//   never reuses memory a stream still uses. Synchronizing on work behind a held stream throws
//   std::logic_error instead of hanging.
// - Copy engines: one per direction (host_to_device, device_to_host), plus device_to_device at
//   device bandwidth. A copy takes latency + bytes / bandwidth and occupies its engine, so copies
//   of different streams in the same direction queue behind each other. Its bytes move when it
//   completes; a source written while it ran (a missing wait on its producer) is counted
//   (counters().copy_sources_changed), since the bytes moved would not show it.
// - Pinned host memory with its own capacity.
// - Fault injection: fail the Nth call (counted from the fail_nth call, 1 = the next) of a site.
//   A failed segment reservation / page map / pinned allocation returns nullptr / false; a failed
//   copy throws spillway::device_error from copy_async, and enqueues nothing.
//
// Stream handles are 1.. (0 is the default stream, which exists from the start); event handles 1...
// Handles are never reused, so a destroyed one stays unknown. All methods are thread-safe (one
// internal mutex).
//
// The details (allocator/src/sim_scheduler.hpp has the mechanics)
// - Timing: a copy ends latency + bytes / bandwidth after it starts; a 0-byte copy is a no-op of
//   duration 0 (nullptr allowed). device_to_device and host_to_host copies share one engine at
//   d2d_bandwidth (concurrent d2d copies share HBM bandwidth anyway). Each op starts where the op
//   it waited for ended, so the timing is exact in manual mode. Copies and kernels are counted in
//   counters() when they complete.
// - Who runs effects: every call that is not noexcept first completes the work due by the current
//   time, and enqueuing calls do so again afterwards (a 0-duration op on an idle stream is done when
//   the call returns). A kernel's effect runs on that calling thread, without the lock; it may call
//   back into the device. In realtime mode any call may run effects, so an effect must not take a
//   lock that callers of the device hold. An exception from an effect propagates out of the call
//   that ran it; the kernel still counts as completed. Memory calls never run effects
//   (the driver latencies in sim_config just move the clock).
// - hold(s) freezes s: an op in flight is cancelled (its engine freed, its effect not applied) and
//   restarts with its full duration at release(s). An effect already running finishes.
// - Blocking calls never sleep: they run the simulation, jumping the clock to the completion they
//   wait for (realtime: by adding to the clock's offset, so now_ns() stays monotonic; advance()
//   adds to it too). When the queued work shows the wait can never end (a held stream on the path,
//   directly or through stream_wait_event, or a kernel effect on the calling thread waiting for its
//   own stream) they throw std::logic_error before running anything.
// - event_completed() never moves the clock in manual mode. An event never recorded is complete;
//   stream_wait_event() on it enqueues nothing. A wait sees the record made before it, as in CUDA.
// - destroy_stream(s) with queued work lifts any hold and lets the work run; s is unknown at once.
//   Stream 0 and unknown handles are ignored.
// - Misuse throws spillway::invalid_argument naming the value: unknown streams or events, null copy
//   pointers, size 0, VMM calls with vmm_granularity 0, map_physical outside a reserved range,
//   unaligned, or over a page already mapped. unmap_physical skips pages that are not mapped
//   and, being noexcept, counts a call not in whole granules (counters().misaligned_unmaps: CUDA
//   would refuse it) and, as CUDA, changes nothing for it; release_address_range also unmaps
//   pages still mapped. Releasing what is not live (release_segment, release_address_range,
//   free_pinned_host: a double release, a pointer never handed out) changes nothing and is
//   counted (counters().invalid_releases), so that tests can catch it. The driver latencies are
//   charged only for releases and unmaps that were made.
//   The destructor unmaps everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "spillway/device_backend.hpp"

namespace spillway {

enum class clock_mode { manual, realtime };

enum class fault_site { segment_reservation, page_map, pinned_host_allocation, copy };

struct sim_config {
  int device_index = 0;
  std::size_t capacity = std::size_t{16} << 30;            // 16 GiB of simulated device memory
  std::size_t pinned_host_capacity = std::size_t{64} << 30; // counted, not pre-reserved
  std::size_t vmm_granularity = std::size_t{2} << 20;       // 0 disables VMM
  clock_mode clock = clock_mode::manual;
  double time_scale = 1.0;                                  // realtime: simulated ns per wall ns
  // Copy engine model (defaults: PCIe Gen5 x16 as measured with pinned memory, H100 HBM3).
  double h2d_bandwidth = 50e9;     // bytes per second
  double d2h_bandwidth = 50e9;
  double d2d_bandwidth = 1.5e12;   // a device-to-device copy reads and writes: half of ~3 TB/s
  std::uint64_t copy_latency_ns = 2000;
  // Driver costs, added to the clock (0: free). What a trace replay charges for the allocator's
  // calls to the driver: a segment reserved or released (cudaMalloc / cudaFree), a map or unmap of
  // pages (cuMemMap / cuMemUnmap, per call), and a device synchronisation beyond draining the
  // queues (the pipeline bubble while the host launches again).
  std::uint64_t segment_reserve_latency_ns = 0;
  std::uint64_t page_map_latency_ns = 0;
  std::uint64_t device_sync_latency_ns = 0;
};

struct sim_counters {
  std::uint64_t segments_reserved = 0;
  std::uint64_t segments_released = 0;
  std::uint64_t pages_mapped = 0;
  std::uint64_t pages_unmapped = 0;
  std::uint64_t misaligned_unmaps = 0;  // unmap_physical calls not in whole granules
  // release_segment, release_address_range and free_pinned_host of what is not live (a double
  // release, a pointer never handed out, one inside a segment): ignored, as CUDA refuses them
  std::uint64_t invalid_releases = 0;
  // copies whose source changed between their start and their completion (sampled: up to 256
  // bytes at its start, middle and end): written while the copy read it, a missing stream wait
  std::uint64_t copy_sources_changed = 0;
  std::uint64_t copies = 0;
  std::uint64_t bytes_copied[4] = {0, 0, 0, 0};  // indexed by copy_kind
  std::uint64_t kernels = 0;
  std::uint64_t faults_injected = 0;
  std::size_t used_bytes = 0;         // device bytes currently reserved or mapped
  std::size_t peak_used_bytes = 0;
  std::size_t pinned_used_bytes = 0;
};

class sim_device final : public device_backend {
 public:
  explicit sim_device(sim_config config = {});
  ~sim_device() override;

  // --- device_backend ---
  int device_index() const noexcept override;
  std::string name() const override;
  std::size_t total_memory() const override;
  std::size_t free_memory() const override;
  void* reserve_segment(std::size_t bytes) override;
  void release_segment(void* ptr, std::size_t bytes) noexcept override;
  void synchronize_device() override;  // runs the simulation until idle; logic_error if a held stream blocks it
  std::size_t vmm_granularity() const noexcept override;
  void* reserve_address_range(std::size_t bytes) override;
  void release_address_range(void* base, std::size_t bytes) noexcept override;
  bool map_physical(void* addr, std::size_t bytes) override;
  void unmap_physical(void* addr, std::size_t bytes) noexcept override;
  stream_ref create_stream() override;
  void destroy_stream(stream_ref s) noexcept override;
  void synchronize_stream(stream_ref s) override;
  event_ref create_event() override;
  void destroy_event(event_ref e) noexcept override;
  void record_event(event_ref e, stream_ref s) override;
  bool event_completed(event_ref e) override;
  void synchronize_event(event_ref e) override;
  void stream_wait_event(stream_ref s, event_ref e) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                  stream_ref s) override;
  void* allocate_pinned_host(std::size_t bytes) override;
  void free_pinned_host(void* ptr, std::size_t bytes) noexcept override;

  // --- simulation ---
  // Enqueues a kernel of `duration_ns` on `s`; `effect` runs (on the thread that advances the
  // clock, without the simulator's lock) when it completes. Use it to write or check bytes.
  void launch(stream_ref s, std::uint64_t duration_ns, std::function<void()> effect = {});
  std::uint64_t now_ns() const;
  void advance(std::uint64_t ns);       // manual mode: move the clock and complete what ends by then
  void run_until_idle();                // complete all work that can complete (not held streams)
  void hold(stream_ref s);              // nothing on s starts or completes until release(s)
  void release(stream_ref s);
  bool stream_idle(stream_ref s) const;

  void fail_nth(fault_site site, std::uint64_t n);  // n >= 1; 0 clears
  void clear_faults();
  sim_counters counters() const;
  const sim_config& config() const noexcept;

 private:
  struct state;
  std::unique_ptr<state> state_;
};

}  // namespace spillway
