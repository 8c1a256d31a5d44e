// evict_sim_run: one replay of an operator trace on a simulated device, with or without an
// eviction engine, under a budget. The model is Note [Eviction simulator model] in docs/simulator.md:
//
// - A sim_device in manual-clock mode, a device_allocator with the budget (reserved bytes), and, unless
//   the mode is `none`, an eviction_engine whose clock is the simulator's (staleness in virtual time).
// - Parameters are allocated first, registered as not evictable. Then, for each op, on one compute
//   stream: pin its inputs together (eviction_engine::pin_all: the engine restores or recomputes
//   them, never evicting one to bring back another), allocate its outputs, launch a kernel of the
//   op's duration, register the outputs with a lineage node whose compute launches the same
//   kernel, wait for the kernel (the host runs one op at a time, so staleness is device time),
//   unpin, and release the buffers whose life ends at this op.
// - Releasing: a buffer that a live lineage node still needs (an input of an op whose outputs are
//   alive) would be kept resident by the engine; with `eager_drop` it is dropped first, as DTR does
//   for tensors whose last reference goes away (it costs nothing unless it is needed to recompute),
//   unless a dropped output of such an op would be recomputed from it: then it stays resident.
//   Spill-only runs register no lineage, so a release frees at once.
// - Kernels, with `verify`, write a signature into each output (at its start, middle and end)
//   derived from the signatures they read from their inputs, and check every input against the
//   expected value: a restore or recompute that brought back wrong bytes is counted.
// - Time is the virtual clock when the last op's kernel completes. Recompute kernels run on the
//   compute stream; restores make it wait for host-to-device copies; spills make allocations wait for
//   the device-to-host copies that free their blocks.
// An out_of_memory (or any other error) ends the run; it is reported as failed at that op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "op_trace.hpp"
#include "spillway/allocator_config.hpp"
#include "spillway/eviction/engine.hpp"

namespace spillway::evsim {

enum class engine_mode { none, hybrid, drop_only, spill_only };
std::string to_string(engine_mode m);
engine_mode parse_mode(const std::string& s);  // "hybrid", "drop", "spill"; invalid_argument otherwise

struct run_config {
  engine_mode mode = engine_mode::hybrid;
  std::string policy = "dtr";
  std::size_t budget = unlimited_budget;   // reserved-bytes cap
  std::size_t capacity = 0;                // simulated device bytes (0: derived from the trace)
  bool expandable = false;
  std::size_t max_split_size = no_split_limit;  // allocator_config::max_split_size
  bool verify = false;
  bool eager_drop = true;
  bool compact = true;                     // engine_config::compact (Note [Compaction])
  bool oom_layout = false;                 // on out of memory, print the segments' layout to stderr
  std::uint64_t seed = 1;
  double max_recompute_factor = eviction::engine_config{}.max_recompute_factor;  // 0: no bound
  double link_bandwidth = 50e9;            // host <-> device, bytes per second, each way
  // Driver costs charged on the simulated clock (sim_config): per segment reserved or released and
  // per page map or unmap call (driver_latency_ns), per device synchronisation (sync_latency_ns).
  std::uint64_t driver_latency_ns = 0;
  std::uint64_t sync_latency_ns = 0;
  std::size_t candidate_samples = 400;     // at most this many candidate counts per run
  // Steps replayed before the measured one, each marked with eviction_engine::begin_step: the
  // engine learns the step's reads and predicts next uses in the steps after (Note [Next-use
  // prediction]). Results count the measured step alone.
  std::size_t warmup_steps = 0;
  // Record memory and the engine's counters over the measured step (run_result::timeline).
  bool timeline = false;
};

// One point of a run's timeline: after `op` ops of the measured step (0: as it began), at `t_ns`
// of virtual time into it. Counters are since the step began; drops are those under pressure
// (as run_result's JSON counts them), eager_drops those at release. allocated / reserved: the
// allocator's; resident: the engine's resident bytes (parameters too).
struct timeline_sample {
  std::uint32_t op = 0;
  std::uint64_t t_ns = 0;
  std::uint64_t allocated = 0, reserved = 0, resident = 0;
  std::uint64_t spills = 0, drops = 0, eager_drops = 0, restores = 0, recomputes = 0;
};
// At most this many points per run: one per op, or, from 2,000 ops, one per window of ops.
inline constexpr std::size_t max_timeline_samples = 2000;

struct run_result {
  bool ok = false;
  bool out_of_memory = false;              // a failure that is out_of_memory (else an error)
  std::string failure;                     // e.g. "out of memory at op 412 (fc7.bwd): ..."
  // "ok", "oom", "error" (any other exception: an engine or replay bug, never a budget's doing)
  // or "corrupt" (finished, but a verified read came back wrong).
  const char* status() const noexcept {
    if (!ok) return out_of_memory ? "oom" : "error";
    return verify_mismatches > 0 ? "corrupt" : "ok";
  }
  std::size_t ops_done = 0;
  std::uint64_t total_ns = 0;              // virtual time when the last op completed
  std::size_t peak_reserved = 0;
  std::size_t peak_allocated = 0;
  eviction::engine_stats engine;           // zero without an engine
  std::uint64_t eager_drops = 0;           // drops at release (not under pressure)
  // Wall time per decision: the mean over each op that made decisions (over windows of ops when the
  // trace has more than 2,000 ops), with the number of decisions as its weight.
  std::vector<std::pair<double, std::uint64_t>> decision_samples;
  std::size_t max_candidates = 0;          // largest sampled count of evictable resident buffers
  std::uint64_t verify_checks = 0;
  std::uint64_t verify_mismatches = 0;
  std::uint64_t allocator_warnings = 0;
  // The allocator's driver traffic: device synchronisations, segments or pages reserved and
  // released, and allocations over the budget that a release served without eviction.
  std::int64_t device_syncs = 0;
  std::int64_t device_allocs = 0;
  std::int64_t device_frees = 0;
  std::int64_t releases_before_eviction = 0;
  double wall_seconds = 0;
  // With run_config::timeline; a run that failed: up to the last point before the op that failed.
  std::vector<timeline_sample> timeline;

  std::uint64_t pressure_evictions() const noexcept { return engine.evictions - eager_drops; }
  std::uint64_t pressure_drops() const noexcept { return engine.drops - eager_drops; }
  double decision_median_ns() const;       // weighted median of the samples (0 without any)
  double decision_mean_ns() const noexcept {
    return engine.decisions ? engine.decision_time_ns / static_cast<double>(engine.decisions) : 0;
  }
};

run_result replay(const op_trace::trace_data& trace, const op_trace::liveness& live, const run_config& config);

// Runs f on a thread with a large stack (recursive recomputation of long chains goes deep).
void run_with_large_stack(const std::function<void()>& f);

}  // namespace spillway::evsim
