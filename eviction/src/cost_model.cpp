// cost_model.cpp: spill or drop from bandwidths and recompute costs, and the bandwidth probe.
// The contract and the cost formulas are in cost_model.hpp.
#include "spillway/eviction/cost_model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

namespace spillway::eviction {
namespace {

constexpr double k_ns_per_s = 1e9;

bool usable_bandwidth(double bytes_per_s) noexcept {
  return bytes_per_s > 0 && std::isfinite(bytes_per_s);
}

}  // namespace

cost_model::cost_model(link_bandwidth bandwidth) : bandwidth_(bandwidth) {
  if (!usable_bandwidth(bandwidth.h2d) || !usable_bandwidth(bandwidth.d2h)) {
    throw invalid_argument("cost_model: bandwidths must be positive and finite (h2d " +
                           std::to_string(bandwidth.h2d) + ", d2h " +
                           std::to_string(bandwidth.d2h) + " bytes/s)");
  }
}

double cost_model::spill_cost_ns(std::size_t bytes, std::size_t d2h_queued_bytes) const noexcept {
  const double restore = static_cast<double>(bytes) / bandwidth_.h2d;
  const double spill_wait = static_cast<double>(d2h_queued_bytes + bytes) / bandwidth_.d2h;
  return (restore + spill_wait) * k_ns_per_s;
}

double cost_model::drop_cost_ns(double recompute_cost_ns,
                                double neighbourhood_cost_ns) const noexcept {
  return recompute_cost_ns + neighbourhood_cost_ns;
}

// mode narrows what is allowed; among what is allowed and possible the cheaper wins, spill on a
// tie (a restore reproduces the bytes without touching the lineage). A NaN drop cost never wins
// against a spill.
eviction_action cost_model::choose(eviction_mode mode, std::size_t bytes,
                                   std::size_t d2h_queued_bytes, bool can_spill, bool can_drop,
                                   double recompute_cost_ns,
                                   double neighbourhood_cost_ns) const noexcept {
  const bool spill_ok = can_spill && mode != eviction_mode::drop;
  const bool drop_ok = can_drop && mode != eviction_mode::spill;
  if (spill_ok && drop_ok) {
    const double drop = drop_cost_ns(recompute_cost_ns, neighbourhood_cost_ns);
    return drop < spill_cost_ns(bytes, d2h_queued_bytes) ? eviction_action::drop
                                                         : eviction_action::spill;
  }
  if (spill_ok) return eviction_action::spill;
  if (drop_ok) return eviction_action::drop;
  return eviction_action::none;
}

namespace {

constexpr std::size_t k_min_probe = size_classes::segment_rounding;  // 2 MiB

// The probe's two buffers: pinned host memory from the backend, device memory from the allocator.
// They are given back only once the stream has drained; if it cannot drain (the wait throws),
// they are leaked rather than freed under copies that may still run.
class probe_buffers {
 public:
  probe_buffers(device_allocator& allocator, stream_ref stream, std::size_t bytes)
      : allocator_(allocator), backend_(allocator.backend()), stream_(stream), bytes_(bytes) {
    host_ = backend_.allocate_pinned_host(bytes);
    if (host_ == nullptr) {
      throw device_error("measure_bandwidth on " + backend_.name() +
                         ": no pinned host memory for a probe of " + format_bytes(bytes));
    }
    try {
      device_ = allocator.allocate(bytes, stream);
    } catch (...) {
      backend_.free_pinned_host(host_, bytes);
      throw;
    }
  }
  ~probe_buffers() {
    try {
      backend_.synchronize_stream(stream_);
    } catch (...) {
      return;
    }
    allocator_.deallocate(device_);
    backend_.free_pinned_host(host_, bytes_);
  }
  probe_buffers(const probe_buffers&) = delete;
  probe_buffers& operator=(const probe_buffers&) = delete;

  void* host() const noexcept { return host_; }
  void* device() const noexcept { return device_; }

 private:
  device_allocator& allocator_;
  device_backend& backend_;
  stream_ref stream_;
  std::size_t bytes_;
  void* host_ = nullptr;
  void* device_ = nullptr;
};

// The probe size: probe_bytes, or less when a segment for it would go over the budget: a whole
// number of the segments' 2 MiB rounding (the least segment the allocator reserves for it,
// size_classes::min_segment_size), at least one. The room is the budget's headroom and what the
// allocator can give back of its cache to make more (releasable_bytes: it does so before any
// handler is asked); a cached block of the probe's own stream is not counted (the engine's probe
// runs on a stream of its own, which none serves).
std::size_t probe_size(const device_allocator& allocator, std::size_t probe_bytes) {
  const std::size_t budget = allocator.budget();
  const auto reserved = static_cast<std::size_t>(allocator.stats().reserved_bytes[0].current);
  const std::size_t room = (budget > reserved ? budget - reserved : 0) + allocator.releasable_bytes();
  std::size_t bytes = probe_bytes;
  if (size_classes::min_segment_size(size_classes::round_size(bytes)) > room) {
    bytes = room / size_classes::segment_rounding * size_classes::segment_rounding;
  }
  if (bytes == 0) {
    out_of_memory::details d;
    d.device = allocator.device();
    d.requested = d.rounded = k_min_probe;
    d.budget = budget;
    d.reserved = reserved;
    d.allocated = static_cast<std::size_t>(allocator.stats().allocated_bytes[0].current);
    d.largest_free = allocator.largest_free_block();
    throw out_of_memory("measure_bandwidth on device " + std::to_string(allocator.device()) +
                        ": no room for a probe of at least " + format_bytes(k_min_probe) +
                        " (budget " + format_bytes(budget) + ", " + format_bytes(reserved) +
                        " reserved); give the bandwidth in engine_config.bandwidth instead",
                        d);
  }
  return bytes;
}

// Bytes per second of `repeats` back-to-back copies, from enqueue to the stream's completion.
double timed_bandwidth(device_backend& backend, stream_ref stream, void* dst, const void* src,
                       std::size_t bytes, copy_kind kind, int repeats) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (int i = 0; i < repeats; ++i) backend.copy_async(dst, src, bytes, kind, stream);
  backend.synchronize_stream(stream);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count();
  // A simulated device may finish within the clock's resolution: count at least 1 ns, so the
  // result stays finite.
  const double seconds = static_cast<double>(std::max<std::int64_t>(ns, 1)) / k_ns_per_s;
  return static_cast<double>(bytes) * repeats / seconds;
}

}  // namespace

link_bandwidth measure_bandwidth(device_allocator& allocator, stream_ref stream,
                                 std::size_t probe_bytes) {
  if (probe_bytes == 0) throw invalid_argument("measure_bandwidth: probe_bytes 0; expected at least 1 byte");
  constexpr int k_repeats = 3;
  device_backend& backend = allocator.backend();
  probe_bytes = probe_size(allocator, probe_bytes);
  probe_buffers buffers(allocator, stream, probe_bytes);
  // Warm-up, one copy each way: first touch of the pages and the engines' start-up stay out of
  // the timing.
  backend.copy_async(buffers.device(), buffers.host(), probe_bytes, copy_kind::host_to_device, stream);
  backend.copy_async(buffers.host(), buffers.device(), probe_bytes, copy_kind::device_to_host, stream);
  backend.synchronize_stream(stream);
  link_bandwidth measured;
  measured.h2d = timed_bandwidth(backend, stream, buffers.device(), buffers.host(), probe_bytes,
                                 copy_kind::host_to_device, k_repeats);
  measured.d2h = timed_bandwidth(backend, stream, buffers.host(), buffers.device(), probe_bytes,
                                 copy_kind::device_to_host, k_repeats);
  return measured;
}

}  // namespace spillway::eviction
