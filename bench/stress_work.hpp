// stress_work: the device work spillway-stress does with its allocations, on either backend.
//
// The stress run checks data integrity through it: every allocation gets a pattern that depends on
// its id, written when it is allocated and checked before it is freed. Work on the other streams an
// allocation was record_stream'ed onto uses the block too, so a block reused before that work is
// done shows up as a corrupted pattern.
//
//   sim   fill/verify write and read the block's bytes directly (the simulated device's memory is
//         host memory): the head, the tail and a few probes in between. use_on_stream launches a
//         short kernel on the other stream whose effect, when it completes, checks the pattern.
//   cuda  fill is a cudaMemsetAsync of the pattern byte on the allocation's stream; verify copies
//         the head and tail back for one allocation in sixteen. use_on_stream enqueues a small
//         memset of the same byte on the other stream (real stream work the free must wait for).
//
// All methods may be called from any worker thread; `thread` picks that thread's scratch state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "spillway/device_backend.hpp"
#include "spillway/sim_device.hpp"

namespace spillway::bench {

enum class check_result { skipped, ok, corrupt };

class stress_work {
 public:
  virtual ~stress_work() = default;

  virtual std::string describe() const = 0;  // one line for the report
  // Writes allocation `id`'s pattern into [ptr, ptr + bytes), in stream order on `stream`.
  virtual void fill(int thread, void* ptr, std::size_t bytes, std::uint64_t id,
                    stream_ref stream) = 0;
  // Checks the pattern before the free. May block on `stream` (CUDA).
  virtual check_result verify(int thread, void* ptr, std::size_t bytes, std::uint64_t id,
                              stream_ref stream) = 0;
  // Enqueues work on `other` (record_stream'ed for this allocation) that uses the block.
  virtual void use_on_stream(int thread, void* ptr, std::size_t bytes, std::uint64_t id,
                             stream_ref other) = 0;
  // Work on `s` that touches no allocation, so events recorded behind it complete later.
  virtual void background(int thread, stream_ref s, std::uint64_t ns) = 0;
  // Waits for every piece of work enqueued so far; afterwards the async counters are final.
  virtual void drain() = 0;

  virtual std::uint64_t async_checks() const noexcept = 0;       // checks done by stream work
  virtual std::uint64_t async_corruptions() const noexcept = 0;  // ... that found a mismatch
  virtual std::uint64_t kernels() const noexcept = 0;            // stream work items enqueued
};

std::unique_ptr<stress_work> make_sim_work(std::shared_ptr<sim_device> sim, int threads);

#ifdef SPILLWAY_WITH_CUDA
// `device` is the CUDA device index the allocator runs on.
std::unique_ptr<stress_work> make_cuda_work(int device, int threads);
#endif

// The pattern: byte `offset` of allocation `id`. Never the same for two ids at most offsets, and
// never all zero (fresh memory).
inline std::uint64_t pattern_seed(std::uint64_t id) noexcept {
  std::uint64_t z = id + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (z ^ (z >> 31)) | 1;
}
inline std::uint8_t pattern_byte(std::uint64_t seed, std::size_t offset) noexcept {
  return static_cast<std::uint8_t>((seed >> ((offset & 7) * 8)) ^ (offset >> 3));
}

}  // namespace spillway::bench
