// rotor_planner: the static planner. Given a chain (a sequential network: stage i maps x_{i-1} to x_i)
// and a memory budget, it returns the cheapest schedule of forwards and backwards (recomputing what
// it dropped) whose peak memory stays within the budget. This is rotor's dynamic program (Beaumont,
// Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for heterogeneous chains"); the
// model, the recurrence and the discretisation are in docs/rotor.md.
//
// Contract:
// - Memory model (real bytes, checked by simulate_schedule): the input x_0 is held for the whole
//   step. forward_checkpoint(i) keeps its input and adds x_i; forward_no_save(i) adds x_i and drops
//   its input (unless that input is part of some xbar); forward_save_all(i) keeps its input and adds
//   xbar_i (which holds x_i). loss turns x_L into the gradient delta_L (same size). backward(i) needs
//   delta_i, xbar_i and x_{i-1}; it adds delta_{i-1} (the size of x_{i-1}) and drops delta_i, xbar_i
//   and x_{i-1} (x_0 excepted). An op's peak is the memory before it plus what it adds plus its
//   stage's overhead; the schedule's peak is the largest op peak.
// - plan_rotor returns the cheapest of rotor's "persistent" schedules (a checkpoint, once a forward
//   has read it and kept it, stays until its backward) that fits budget_bytes in real bytes. Memory is
//   discretised into slots of ceil(budget / memory_slots) bytes and every size is rounded UP, so a plan
//   found in slots fits in bytes. The plan is optimal when every size is a multiple of the slot;
//   otherwise rounding may cost a little (the tables reach past the budget to win most of it back).
//   With exact slots, more budget never costs more. When storing everything fits, the plan is "store
//   all" (extra_cost 0).
// - feasible is false exactly when budget_bytes < rotor_min_budget(chain), computed in real bytes. Just
//   above it the slot grid may find nothing; the plan is then the least-memory schedule, flagged
//   least_memory_fallback (feasible, not necessarily cheapest).
// - rotor_lower_bound is the same program with sizes rounded DOWN: no persistent schedule within the
//   budget costs less. Schedules that drop a kept checkpoint (non-persistent) can cost less than both.
// - plan_brute_force searches every valid schedule (Dijkstra over memory states; exponential, at most
//   8 stages), persistent or any, to check the planner.
// - Every plan's cost and peak are measured by simulate_schedule (a plan it rejects is a logic_error).
// - Bad input (no stages, negative or non-finite costs, xbar smaller than x, memory_slots 0, budget 0,
//   sizes whose sum overflows, tables too large) throws spillway::invalid_argument naming the value and
//   what was expected. Pure functions of their arguments: thread-safe, no device memory.
// - Time O(L^3 * M), memory O(L^2 * M) for L stages and M slots: ~0.02 s for L = 50 and ~0.2 s, 45 MB
//   for L = 100 at M = 500 (docs/rotor.md).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace spillway::eviction {

// One stage of the chain. Sizes are in bytes; costs in any time unit (they are only added up).
struct chain_stage {
  double forward_cost = 0;   // uf_i: one forward of the stage, of any kind
  double backward_cost = 0;  // ub_i: its backward
  std::size_t x_bytes = 0;   // x_i: the stage's output, the next stage's input; its gradient is as big
  // xbar_i: what forward_save_all leaves: the output x_i plus everything the backward needs that is
  // not x_{i-1}. At least x_bytes (rotor's xbar contains x).
  std::size_t xbar_bytes = 0;
  std::size_t forward_overhead_bytes = 0;  // transient memory of a forward beyond its input and output
  std::size_t backward_overhead_bytes =
      0;  // transient memory of the backward beyond what it reads and writes
};

struct chain {
  std::vector<chain_stage> stages;  // stage i of the paper (1-based) is stages[i - 1]
  std::size_t input_bytes = 0;      // x_0: held by the caller for the whole step; delta_0 is as big
};

// rotor's operations: F_ck, F_n (F_∅), F_all, the loss, B.
enum class op_kind { forward_checkpoint, forward_no_save, forward_save_all, loss, backward };

struct schedule_op {
  op_kind kind;
  int stage;  // index into chain::stages; the loss uses stages.size()
  friend bool operator==(const schedule_op&, const schedule_op&) = default;
};

struct rotor_plan {
  bool feasible = false;
  double total_cost = 0;       // compute time of the schedule, recomputation included (+inf if infeasible)
  double extra_cost = 0;       // total_cost - (sum of forward costs + sum of backward costs)
  std::size_t peak_bytes = 0;  // measured by simulate_schedule, in real bytes (0 if infeasible)
  std::vector<schedule_op> ops;
  std::size_t slot_bytes = 0;          // the discretisation unit the DP used (0: no DP ran)
  bool least_memory_fallback = false;  // the slot grid found nothing; ops is the least-memory schedule
};

rotor_plan plan_rotor(const chain& c, std::size_t budget_bytes, std::size_t memory_slots = 500);

// No persistent schedule within budget_bytes costs less than this (+inf: none fits even with sizes
// rounded down). Equals plan_rotor's cost when every size is a multiple of the slot.
double rotor_lower_bound(const chain& c, std::size_t budget_bytes, std::size_t memory_slots = 500);

// The smallest budget (real bytes) for which plan_rotor finds a schedule: the least peak over
// persistent schedules, by an exact min-max version of the same recurrence. O(L^3).
std::size_t rotor_min_budget(const chain& c);

struct schedule_simulation {
  bool valid = false;
  double cost = 0;             // sum of the op costs (up to the first invalid op)
  std::size_t peak_bytes = 0;  // largest op peak in real bytes (up to the first invalid op)
  bool persistent = true;      // no forward_no_save dropped a value that an earlier forward had kept
  std::string error;           // why the schedule is invalid, naming the op and its index
};

// Runs ops against the memory model above, independently of the planner: every op must find its
// inputs in memory, must not recompute a value that is already there or that nothing can use, and at
// the end every backward has run (in order L..1, after the loss).
schedule_simulation simulate_schedule(const chain& c, const std::vector<schedule_op>& ops);

enum class schedule_class {
  persistent,  // the class plan_rotor is optimal over
  any,         // also lets forward_no_save drop a kept checkpoint (recompute it later)
};

// Exhaustive search for the cheapest valid schedule within budget_bytes (real bytes, no rounding).
// Exponential in the number of stages; throws invalid_argument beyond 8 stages.
rotor_plan plan_brute_force(const chain& c, std::size_t budget_bytes,
                            schedule_class scope = schedule_class::persistent);

// "Fck0 Fn1 Fall2 Loss B2 ...": for messages and logs.
std::string to_string(op_kind kind);
std::string describe_schedule(const std::vector<schedule_op>& ops);

}  // namespace spillway::eviction
