// cost_model: spill or drop, per tensor, from measured numbers.
//
// For a victim of `bytes` that could be spilled and/or recomputed:
//   spill cost   = the wait before the evicted block is free: the buffer's own device-to-host
//                  copy behind the bytes already queued ((queued + bytes) / d2h_bandwidth; the
//                  allocation that caused the eviction waits for it), plus the restore time
//                  bytes / h2d_bandwidth: the parts of a round trip that can land on the
//                  critical path
//   drop cost    = recompute_cost_ns of its node, plus the cost of evicted inputs it would need
//                  (the evicted neighbourhood's cost, DTR's e*)
// choose() picks the cheaper allowed one; spilling needs host memory, dropping needs lineage.
// Bandwidths are measured (measure_bandwidth) or configured (the simulated device's model).
// See Note [Spill or drop] in docs/eviction.md.
#pragma once

#include <cstddef>

#include "spillway/device_allocator.hpp"
#include "spillway/device_backend.hpp"
#include "spillway/eviction/buffer.hpp"

namespace spillway::eviction {

struct link_bandwidth {
  double h2d = 0;  // bytes per second
  double d2h = 0;
};

enum class eviction_action { spill, drop, none };

class cost_model {
 public:
  explicit cost_model(link_bandwidth bandwidth);  // invalid_argument if a bandwidth is <= 0

  double spill_cost_ns(std::size_t bytes, std::size_t d2h_queued_bytes) const noexcept;
  double drop_cost_ns(double recompute_cost_ns, double neighbourhood_cost_ns) const noexcept;

  // mode restricts the choice; can_drop: lineage exists; can_spill: host memory is expected.
  eviction_action choose(eviction_mode mode, std::size_t bytes, std::size_t d2h_queued_bytes,
                         bool can_spill, bool can_drop, double recompute_cost_ns,
                         double neighbourhood_cost_ns) const noexcept;

  const link_bandwidth& bandwidth() const noexcept { return bandwidth_; }

 private:
  link_bandwidth bandwidth_;
};

// Times pinned copies of up to `probe_bytes` each way on `stream` with the host clock and
// synchronisation; returns the measured bandwidth. The device side of the probe is an allocation
// of `allocator`, so it counts against the budget like any other: when a segment for probe_bytes
// would go over the budget, the probe shrinks to what a segment within the budget's headroom,
// and the cache the allocator can give back, holds (whole 2 MiB), down to 2 MiB, and below that
// it is out_of_memory naming the budget. The memory goes back to the cache.
// Pinned host memory comes from the backend and goes back to it; none is a device_error. For a
// simulated device in manual mode use its configured model instead (the host clock does not move
// with the virtual one).
link_bandwidth measure_bandwidth(device_allocator& allocator, stream_ref stream,
                                 std::size_t probe_bytes = std::size_t{64} << 20);

}  // namespace spillway::eviction
