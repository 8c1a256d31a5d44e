// evict_sim_chain: reads a chain (rotor_planner.hpp) out of an operator trace, so the simulator can
// report rotor's static optimum next to the dynamic policies.
//
// How (docs/simulator.md, "The rotor optimum"):
// - The forward phase is the ops before `phase backward`. A *constant* is a forward buffer computed
//   from parameters and constants only and never read by the backward (an attention mask).
// - A cut after forward op p is valid when exactly one forward buffer that is neither a parameter
//   nor a constant is written at or before p and read after p: that buffer is the stage's x_i.
//   Stages are the runs of ops between valid cuts. A chain-like trace (an MLP) has a cut after
//   every op; a ResNet one after every block; a trace with long skips (a U-Net) few or none.
// - Two decompositions (cut_rule): every valid cut, or only those whose x_i the backward reads.
//   rotor keeps x_i in its stage's x-bar until that stage's backward, so a cut at a buffer only
//   the next forward op reads (a linear's output that only its relu reads) makes rotor hold it
//   for nothing; without those cuts the buffer is a transient of a longer stage, and rotor
//   cannot checkpoint it. Neither is better on every trace: the simulator reports, at each
//   budget, the better of the two (best_rotor_at), so the bound stays rotor's best.
// - Stage i: forward_cost = the sum of its ops' durations; x_bytes = |x_i| (the loss for the last
//   stage); xbar_bytes = |x_i| + the other buffers it writes that a backward op reads (saved for
//   backward); forward_overhead = the most bytes of its other buffers alive at one of its ops.
//   Backward ops are attributed to the latest stage whose buffers they read (this only splits
//   backward_cost between stages; it changes total_cost, never extra_cost); backward overheads are 0.
// - Sizes are rounded as the allocator rounds them (512 bytes). Parameters (initial and produced)
//   and constants are outside rotor's model: `fixed_bytes` is the most of them alive at once in
//   the forward (each from its producer, or the start, to its release, or the end), held for the
//   whole step; gradients the backward produces are not charged. rotor's budget at a device
//   budget B is B - fixed_bytes. input_bytes is 0: the first stage reads parameters.
// rotor's model is exact for the synthetic mlp (one op per stage, no transients, its gradients
// preallocated). Elsewhere it favours rotor: no fragmentation, no segment granularity, no backward
// temporaries, and no room taken by the gradients the backward produces; its figures are then a
// lower bound, not a schedule the engine could run.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "op_trace.hpp"
#include "spillway/eviction/rotor_planner.hpp"

namespace spillway::evsim {

struct chain_model {
  bool ok = false;
  std::string why;                    // when !ok: why the trace is not a chain
  eviction::chain chain;
  std::size_t fixed_bytes = 0;        // parameters and constants, rounded
  // The most bytes of parameters produced in the backward (gradients) alive at once: memory the
  // engine holds that rotor's model leaves out. 0 for the synthetic traces (their gradients are
  // preallocated parameters), where rotor's model is exact.
  std::size_t backward_param_bytes = 0;
  std::vector<std::size_t> stage_last_op;  // the last forward op of each stage
};

enum class cut_rule { every_cut, saved_cuts };

chain_model extract_chain(const op_trace::trace_data& trace, const op_trace::liveness& live,
                          cut_rule rule = cut_rule::every_cut);

struct rotor_point {
  bool feasible = false;
  double extra_cost_ns = 0;   // recomputation of the optimal persistent schedule
  double total_cost_ns = 0;
  std::size_t peak_bytes = 0; // the plan's peak + fixed_bytes
  bool least_memory_fallback = false;
  // rotor_lower_bound's extra compute at this budget: no persistent schedule costs less (the plan
  // rounds sizes up to its slots, so it may cost more than the true optimum; best_rotor_at: the
  // least over the decompositions). 0 when store-all fits.
  double lower_bound_extra_ns = 0;
  std::size_t stages = 0;     // of the decomposition planned (best_rotor_at: the better one)
  double plan_seconds = 0;    // host wall time of plan_rotor (best_rotor_at: of every decomposition)
};

// rotor at a device budget (bytes); infeasible when the budget does not cover fixed_bytes.
rotor_point rotor_at(const chain_model& c, std::size_t device_budget, std::size_t memory_slots = 500);
// rotor_min_budget(chain) + fixed_bytes.
std::size_t rotor_min_device_budget(const chain_model& c);

// The better of rotor's plans over several decompositions of one trace: the feasible one with
// the least extra cost; and the least minimum budget among them. Models that are not ok are skipped.
rotor_point best_rotor_at(const std::vector<const chain_model*>& models, std::size_t device_budget,
                          std::size_t memory_slots = 500);
std::size_t best_rotor_min_device_budget(const std::vector<const chain_model*>& models);

}  // namespace spillway::evsim
