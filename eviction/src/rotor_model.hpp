// rotor_model: the chain in the paper's 1-based numbering, shared by the planner, the brute force and
// the simulator; and input validation.
//
// Values x_0..x_L, stages 1..L (stage i is chain::stages[i - 1]); x[L + 1] = 0 is a sentinel so that
// "the gradient that is live while a segment ending at stage L + 1 (the loss) runs" has size 0.
// Sizes are in whatever unit the caller chose: bytes, or slots after discretise().
#pragma once

#include <cstddef>
#include <vector>

#include "spillway/eviction/rotor_planner.hpp"

namespace spillway::eviction::detail {

struct chain_model {
  int length = 0;                 // L
  std::vector<std::size_t> x;     // x[0..L], x[L + 1] = 0; gradient delta_i has size x[i]
  std::vector<std::size_t> xbar;  // xbar[1..L]
  std::vector<std::size_t> fwd_overhead, bwd_overhead;  // [1..L]
  std::vector<double> fwd_cost, bwd_cost;               // [1..L]
  double base_cost = 0;  // sum of all forward and backward costs: the no-recompute cost
};

// Throws spillway::invalid_argument naming `who`, the bad value and what was expected.
chain_model make_model(const chain& c, const char* who);

// Every size in whole slots of `slot` bytes. Rounded up, sums of slots bound sums of bytes from
// above (plans fit); rounded down, from below (a relaxation: costs are lower bounds).
enum class rounding { up, down };
chain_model discretise(const chain_model& bytes, std::size_t slot, rounding how);

// F_all for every stage, the loss, then every backward: the only schedule without recompute.
std::vector<schedule_op> store_all_schedule(int length);

}  // namespace spillway::eviction::detail
