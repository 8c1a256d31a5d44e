// trace_player: plays an alloc/free trace against spillway's device_allocator and measures what it
// reserved. Used by spillway-replay (trace_replay.cpp) and the tests.
//
// Contract
// - Each call builds a fresh backend (make_backend: sim, cuda or auto) and a fresh allocator with
//   the options' budget and expandable segments, and plays the events in order: alloc ->
//   allocate(size, stream), free -> deallocate, record_stream -> record_stream. Trace stream 0 is
//   the backend's default stream; other trace streams are created on the backend on first use.
// - An allocation that throws out_of_memory is counted and the replay goes on; the free and
//   record_stream events of that id are skipped (and counted).
// - On the simulated device the clock follows the trace: before each event it advances to the
//   event's t_ns. (Nothing else runs on the simulated streams, so cross-stream frees complete as
//   soon as the allocator looks at their events.)
// - Only the event loop is timed. Afterwards every allocation still live is freed, the device is
//   synchronised and the cache emptied (so cross-stream frees have completed), and the
//   allocator, its streams and the backend are destroyed.
// - The trace must be valid (read_trace / parse_trace only return valid ones).
//   Device failures other than out of memory propagate (device_error).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "spillway/allocator_config.hpp"
#include "trace_format.hpp"

namespace spillway::trace {

// The simulated device's size for a trace whose header does not say (device_capacity=0): an
// 80 GB GPU's, so that a recorded trace does not run out of memory for want of a number.
inline constexpr std::size_t unknown_capacity_default = std::size_t{80} << 30;

struct replay_options {
  std::string device = "auto";    // sim | cuda | auto
  int device_index = 0;
  std::size_t capacity = 0;       // simulated device bytes; 0: the trace header's, else 80 GiB
  std::size_t budget = unlimited_budget;
  bool expandable = false;        // allocator_config::expandable_segments
};

struct replay_result {
  std::string device_kind;        // "sim" or "cuda"
  std::string device_name;        // backend.name()
  std::string device_why;         // backend_choice::why
  std::size_t capacity = 0;       // the backend's total memory
  trace_summary trace;

  std::int64_t peak_allocated = 0;   // memory_stats::allocated_bytes (aggregate).peak
  std::int64_t peak_reserved = 0;    // memory_stats::reserved_bytes (aggregate).peak
  std::int64_t peak_requested = 0;   // memory_stats::requested_bytes (aggregate).peak
  std::int64_t peak_segments = 0;    // memory_stats::segment (aggregate).peak
  std::int64_t device_allocs = 0;    // memory_stats::num_device_alloc (segments reserved / pages mapped)
  std::int64_t alloc_retries = 0;    // memory_stats::num_alloc_retries
  std::uint64_t ooms = 0;            // allocations that threw out_of_memory
  std::uint64_t skipped = 0;         // frees / record_streams of ids whose allocation failed
  std::uint64_t warnings = 0;        // messages through allocator_config::on_warning
  std::vector<std::string> first_warnings;  // up to 5
  double seconds = 0;                // wall time of the event loop

  // peak_reserved / peak_allocated: 1.0 is no fragmentation at all. 0 when nothing was allocated.
  double fragmentation() const noexcept {
    return peak_allocated > 0 ? static_cast<double>(peak_reserved) / static_cast<double>(peak_allocated) : 0;
  }
  // From the trace header: what PyTorch reserved at its peak over the same events, and that over
  // this replay's peak allocated bytes (the same requests, rounded by the same size table).
  std::optional<std::size_t> torch_peak_reserved;
  std::optional<double> torch_fragmentation() const noexcept {
    if (!torch_peak_reserved || peak_allocated <= 0) return std::nullopt;
    return static_cast<double>(*torch_peak_reserved) / static_cast<double>(peak_allocated);
  }
};

replay_result replay(const trace_data& trace, const replay_options& options);

}  // namespace spillway::trace
