// trace_player: the replay loop. The contract is in trace_player.hpp.
#include "trace_player.hpp"

#include <chrono>

#include "bench_common.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"

namespace spillway::trace {
namespace {

constexpr int agg = static_cast<int>(stat_type::aggregate);

// Trace streams -> backend streams, created on first use and destroyed with the map.
class stream_map {
 public:
  explicit stream_map(device_backend& backend) : backend_(backend) {}
  ~stream_map() {
    for (std::size_t i = 1; i < streams_.size(); ++i) {
      if (created_[i]) backend_.destroy_stream(streams_[i]);
    }
  }
  stream_map(const stream_map&) = delete;
  stream_map& operator=(const stream_map&) = delete;

  stream_ref get(std::uint32_t s) {
    if (s == 0) return {};
    if (s >= streams_.size()) {
      streams_.resize(s + 1);
      created_.resize(s + 1, false);
    }
    if (!created_[s]) {
      streams_[s] = backend_.create_stream();
      created_[s] = true;
    }
    return streams_[s];
  }

 private:
  device_backend& backend_;
  std::vector<stream_ref> streams_{stream_ref{}};
  std::vector<bool> created_{false};
};

}  // namespace

replay_result replay(const trace_data& trace, const replay_options& options) {
  replay_result r;
  r.trace = summarize(trace);
  r.torch_peak_reserved = trace.head.torch_peak_reserved;

  sim_config sim;
  sim.capacity = options.capacity ? options.capacity
                 : trace.head.device_capacity ? trace.head.device_capacity
                                              : unknown_capacity_default;
  bench::backend_choice choice = bench::make_backend(options.device, options.device_index, sim);
  r.device_kind = choice.kind;
  r.device_name = choice.backend->name();
  r.device_why = choice.why;
  r.capacity = choice.backend->total_memory();

  allocator_config config;
  config.budget = options.budget;
  config.expandable_segments = options.expandable;
  config.on_warning = [&r](const std::string& message) {
    if (r.first_warnings.size() < 5) r.first_warnings.push_back(message);
    ++r.warnings;
  };

  stream_map streams(*choice.backend);  // outlives the allocator: its events may sit on them
  std::vector<void*> ptr(r.trace.id_limit, nullptr);  // nullptr: not live, or its alloc failed
  {
    device_allocator allocator(choice.backend, config);
    sim_device* clock = choice.sim.get();
    std::uint64_t now_ns = 0;

    const auto start = std::chrono::steady_clock::now();
    for (const event& e : trace.events) {
      if (clock && e.t_ns > now_ns) {
        clock->advance(e.t_ns - now_ns);
        now_ns = e.t_ns;
      }
      switch (e.kind) {
        case op::alloc:
          try {
            ptr[e.id] = allocator.allocate(e.size, streams.get(e.stream));
          } catch (const out_of_memory&) {
            ++r.ooms;
          }
          break;
        case op::free:
          if (ptr[e.id]) {
            allocator.deallocate(ptr[e.id]);
            ptr[e.id] = nullptr;
          } else {
            ++r.skipped;
          }
          break;
        case op::record_stream:
          if (ptr[e.id]) {
            allocator.record_stream(ptr[e.id], streams.get(e.stream));
          } else {
            ++r.skipped;
          }
          break;
      }
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    const memory_stats s = allocator.stats();
    r.peak_allocated = s.allocated_bytes[agg].peak;
    r.peak_reserved = s.reserved_bytes[agg].peak;
    r.peak_requested = s.requested_bytes[agg].peak;
    r.peak_segments = s.segment[agg].peak;
    r.device_allocs = s.num_device_alloc;
    r.alloc_retries = s.num_alloc_retries;
    for (void*& p : ptr) {
      if (p) allocator.deallocate(p);
      p = nullptr;
    }
    // Let the events of cross-stream frees complete and reap them, so that the allocator is
    // destroyed with nothing pending.
    choice.backend->synchronize_device();
    allocator.empty_cache();
  }
  return r;
}

}  // namespace spillway::trace
