// rotor_planner: rotor's dynamic program over (segment, memory) and the exact least-memory variant
// behind rotor_min_budget. The recurrence is derived in docs/rotor.md; in short, C(s, t, m) is the
// cheapest way to run stages s..t forward and backward with m slots, given that x_{s-1} is held
// outside m and that the gradient delta_t is live inside m (t = L + 1 stands for the loss, whose
// "gradient" x[L + 1] is 0). The first op is either
//   chain: F_all(s), then [s+1, t] with m - xbar_s, then B(s); or
//   leaf j: F_ck(s), F_n(s+1..j-1), then [j, t] with m - x_{j-1}, then [s, j-1] with m.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "rotor_model.hpp"
#include "spillway/errors.hpp"

namespace spillway::eviction {
namespace {

using detail::chain_model;
constexpr double inf = std::numeric_limits<double>::infinity();
constexpr std::size_t max_table_cells = std::size_t{1} << 28;  // 3 GiB of tables: surely a mistake

// Segments [s, t], 1 <= s <= t <= L + 1, numbered densely.
std::size_t pair_index(int s, int t) { return static_cast<std::size_t>(t) * (t - 1) / 2 + (s - 1); }
std::size_t pair_count(int length) { return static_cast<std::size_t>(length + 1) * (length + 2) / 2; }

// Every table has a row per segment [s, t] (pair_count), times the slots for the cost tables: a
// chain too long for even one slot would ask for gigabytes (and hours) before failing.
void check_table_rows(const char* who, const chain_model& m) {
  if (2 * pair_count(m.length) > max_table_cells)
    throw spillway::invalid_argument(
        std::string(who) + ": the chain has " + std::to_string(m.length) +
        " stages; expected few enough for stages^2 table rows (about 10000 at most)");
}

// Emits ops for one step of the recurrence; `recurse(s, t, delta)` emits a sub-segment whose memory
// is the parent's minus `delta`. choice 0 is the chain step, j >= 1 the leaf step with checkpoint x_{j-1}.
template <class Recurse>
void emit_step(const chain_model& m, int s, int t, int choice, std::vector<schedule_op>& out,
               Recurse recurse) {
  const int L = m.length;
  if (s == L + 1) {
    out.push_back({op_kind::loss, L});
  } else if (choice == 0) {
    out.push_back({op_kind::forward_save_all, s - 1});
    if (s < t) recurse(s + 1, t, m.xbar[s]);
    out.push_back({op_kind::backward, s - 1});
  } else {
    const int j = choice;
    out.push_back({op_kind::forward_checkpoint, s - 1});
    for (int k = s + 1; k < j; ++k) out.push_back({op_kind::forward_no_save, k - 1});
    recurse(j, t, m.x[j - 1]);
    recurse(s, j - 1, 0);
  }
}

// The peak of the forward run F_ck(s), F_n(s+1..j-1) is updated incrementally as j grows.
std::size_t leaf_forward_peak(const chain_model& m, int s, int j, std::size_t grad, std::size_t so_far) {
  if (j - 1 == s) return grad + m.x[s] + m.fwd_overhead[s];
  return std::max(so_far, grad + m.x[j - 2] + m.x[j - 1] + m.fwd_overhead[j - 1]);
}

// C(s, t, m) for every segment and m = 0..slots, in flat rows of slots + 1 entries.
class cost_table {
 public:
  cost_table(const chain_model& m, std::size_t slots) : m_(m), width_(slots + 1) {
    const int L = m.length;
    cost_.assign(pair_count(L) * width_, inf);
    choice_.assign(pair_count(L) * width_, -1);
    // t ascending, s descending: [s+1, t], [j, t] and [s, j-1] are all done before [s, t].
    for (int t = 1; t <= L + 1; ++t)
      for (int s = t; s >= 1; --s) fill(s, t);
  }

  double cost(int s, int t, std::size_t mem) const { return cost_[row(s, t) + mem]; }

  void emit(int s, int t, std::size_t mem, std::vector<schedule_op>& out) const {
    emit_step(m_, s, t, choice_[row(s, t) + mem], out,
              [&](int s2, int t2, std::size_t held) { emit(s2, t2, mem - held, out); });
  }

 private:
  std::size_t row(int s, int t) const { return pair_index(s, t) * width_; }

  void fill(int s, int t) {
    const chain_model& m = m_;
    const std::size_t top = width_ - 1;
    double* c = &cost_[row(s, t)];
    std::int32_t* w = &choice_[row(s, t)];
    if (s == m.length + 1) {  // the loss: x_L (outside m) becomes delta_L (inside m)
      for (std::size_t mem = m.x[s - 1]; mem <= top; ++mem) c[mem] = 0, w[mem] = 0;
      return;
    }
    const std::size_t grad = m.x[t];  // delta_t, live through the whole segment
    {  // chain: F_all(s) peaks with delta_t; B(s) with xbar_s, delta_s and its output delta_{s-1}
      const std::size_t xb = m.xbar[s];
      const std::size_t need =
          std::max(grad + xb + m.fwd_overhead[s], xb + m.x[s] + m.x[s - 1] + m.bwd_overhead[s]);
      const double here = m.fwd_cost[s] + m.bwd_cost[s];
      if (s == t) {
        for (std::size_t mem = need; mem <= top; ++mem) c[mem] = here, w[mem] = 0;
      } else {
        const double* sub = &cost_[row(s + 1, t)];
        for (std::size_t mem = std::max(need, xb); mem <= top; ++mem) {
          const double v = here + sub[mem - xb];
          if (v < c[mem]) c[mem] = v, w[mem] = 0;
        }
      }
    }
    std::size_t fwd = 0;
    double run = 0;
    for (int j = s + 1; j <= t; ++j) {  // leaf: checkpoint x_{j-1}; strict < keeps the chain on ties
      fwd = leaf_forward_peak(m, s, j, grad, fwd);
      run += m.fwd_cost[j - 1];
      const std::size_t ck = m.x[j - 1];
      const double* right = &cost_[row(j, t)];
      const double* left = &cost_[row(s, j - 1)];
      for (std::size_t mem = std::max(fwd, ck); mem <= top; ++mem) {
        const double v = run + right[mem - ck] + left[mem];
        if (v < c[mem]) c[mem] = v, w[mem] = j;
      }
    }
  }

  const chain_model& m_;
  std::size_t width_;
  std::vector<double> cost_;
  std::vector<std::int32_t> choice_;
};

// The same recurrence with max instead of + over memory: the least peak P(s, t) of each segment in
// real bytes (exact, no slots), ties broken by cost.
class least_memory {
 public:
  explicit least_memory(const chain_model& m)
      : m_(m), peak_(pair_count(m.length)), cost_(pair_count(m.length)), choice_(pair_count(m.length)) {
    const int L = m.length;
    for (int t = 1; t <= L + 1; ++t)
      for (int s = t; s >= 1; --s) fill(s, t);
  }

  std::size_t budget() const { return m_.x[0] + peak_[pair_index(1, m_.length + 1)]; }

  void emit(int s, int t, std::vector<schedule_op>& out) const {
    emit_step(m_, s, t, choice_[pair_index(s, t)], out,
              [&](int s2, int t2, std::size_t) { emit(s2, t2, out); });
  }

 private:
  void fill(int s, int t) {
    const chain_model& m = m_;
    const std::size_t at = pair_index(s, t);
    if (s == m.length + 1) {
      peak_[at] = m.x[s - 1], cost_[at] = 0, choice_[at] = 0;
      return;
    }
    const std::size_t grad = m.x[t];
    const std::size_t xb = m.xbar[s];
    std::size_t best_peak =
        std::max(grad + xb + m.fwd_overhead[s], xb + m.x[s] + m.x[s - 1] + m.bwd_overhead[s]);
    double best_cost = m.fwd_cost[s] + m.bwd_cost[s];
    int best = 0;
    if (s < t) {
      best_peak = std::max(best_peak, xb + peak_[pair_index(s + 1, t)]);
      best_cost += cost_[pair_index(s + 1, t)];
    }
    std::size_t fwd = 0;
    double run = 0;
    for (int j = s + 1; j <= t; ++j) {
      fwd = leaf_forward_peak(m, s, j, grad, fwd);
      run += m.fwd_cost[j - 1];
      const std::size_t right = pair_index(j, t), left = pair_index(s, j - 1);
      const std::size_t p = std::max({fwd, m.x[j - 1] + peak_[right], peak_[left]});
      const double q = run + cost_[right] + cost_[left];
      if (p < best_peak || (p == best_peak && q < best_cost)) best_peak = p, best_cost = q, best = j;
    }
    peak_[at] = best_peak, cost_[at] = best_cost, choice_[at] = best;
  }

  const chain_model& m_;
  std::vector<std::size_t> peak_;
  std::vector<double> cost_;
  std::vector<int> choice_;
};

// Measures the schedule with the independent simulator; a planner bug is a logic_error, not a plan.
rotor_plan finish(const chain& c, const chain_model& m, std::vector<schedule_op> ops, std::size_t budget,
                  std::size_t slot, bool fallback) {
  const schedule_simulation sim = simulate_schedule(c, ops);
  if (!sim.valid || sim.peak_bytes > budget)
    throw std::logic_error(
        "plan_rotor: internal error: planned schedule " +
        (sim.valid ? "peaks at " + format_bytes(sim.peak_bytes) + " > budget " + format_bytes(budget)
                   : "is invalid: " + sim.error));
  rotor_plan plan;
  plan.feasible = true;
  plan.total_cost = sim.cost;
  plan.extra_cost = sim.cost - m.base_cost;
  plan.peak_bytes = sim.peak_bytes;
  plan.ops = std::move(ops);
  plan.slot_bytes = slot;
  plan.least_memory_fallback = fallback;
  return plan;
}

}  // namespace

std::size_t rotor_min_budget(const chain& c) {
  const chain_model m = detail::make_model(c, "rotor_min_budget");
  check_table_rows("rotor_min_budget", m);
  return least_memory(m).budget();
}

namespace {

// The checks plan_rotor and rotor_lower_bound share; returns ceil(budget / memory_slots).
std::size_t slot_size(const char* who, const chain_model& m, std::size_t budget_bytes,
                      std::size_t memory_slots) {
  if (memory_slots == 0)
    throw spillway::invalid_argument(std::string(who) +
                                     ": memory_slots is 0; expected at least 1 (500 is rotor's default)");
  if (budget_bytes == 0)
    throw spillway::invalid_argument(std::string(who) + ": budget_bytes is 0; expected a positive budget");
  const std::size_t slot = budget_bytes / memory_slots + (budget_bytes % memory_slots != 0 ? 1 : 0);
  check_table_rows(who, m);
  const std::size_t limit = max_table_cells / (2 * pair_count(m.length));
  if (budget_bytes / slot > limit)
    throw spillway::invalid_argument(std::string(who) + ": memory_slots is " + std::to_string(memory_slots) +
                                     " for " + std::to_string(m.length) + " stages; expected at most " +
                                     std::to_string(limit) + " (the tables grow as stages^2 * slots)");
  return slot;
}

bool store_all_fits(const chain& c, const chain_model& m, std::size_t budget_bytes) {
  return simulate_schedule(c, detail::store_all_schedule(m.length)).peak_bytes <= budget_bytes;
}

}  // namespace

rotor_plan plan_rotor(const chain& c, std::size_t budget_bytes, std::size_t memory_slots) {
  const chain_model m = detail::make_model(c, "plan_rotor");
  const std::size_t slot = slot_size("plan_rotor", m, budget_bytes, memory_slots);
  const int L = m.length;

  // Storing everything runs each op once: no schedule is cheaper, so take it whenever it fits.
  if (store_all_fits(c, m, budget_bytes))
    return finish(c, m, detail::store_all_schedule(L), budget_bytes, 0, false);

  const least_memory least(m);
  if (budget_bytes < least.budget()) {
    rotor_plan none;
    none.total_cost = none.extra_cost = inf;
    return none;
  }

  // Every size rounds up to slots of ceil(budget / memory_slots) bytes, so slot sums bound byte sums.
  // Rounding costs each live value under one slot, and an op has at most 2L + 4 of them live, so the
  // table reaches that far past the budget: plans that fit in bytes despite rounding are candidates
  // too (docs/rotor.md, "Discretisation").
  const std::size_t slots = budget_bytes / slot;
  const std::size_t headroom = std::min<std::size_t>(2 * static_cast<std::size_t>(L) + 5, slots);
  const chain_model q = detail::discretise(m, slot, detail::rounding::up);
  if (q.x[0] <= slots + headroom) {
    const cost_table table(q, slots + headroom);
    // Costs fall as memory grows: the first plan from the top that fits in bytes is the cheapest.
    // Every plan at or below `slots` fits, so the scan stops there at the latest.
    for (std::size_t total = slots + headroom; total >= std::max(slots, q.x[0]); --total) {
      const std::size_t mem = total - q.x[0];
      if (!(table.cost(1, L + 1, mem) < inf)) break;
      std::vector<schedule_op> ops;
      table.emit(1, L + 1, mem, ops);
      if (total <= slots || simulate_schedule(c, ops).peak_bytes <= budget_bytes)
        return finish(c, m, std::move(ops), budget_bytes, slot, false);
    }
  }
  // The budget fits a schedule in bytes but rounding to slots lost it: fall back to the least peak.
  std::vector<schedule_op> ops;
  least.emit(1, L + 1, ops);
  return finish(c, m, std::move(ops), budget_bytes, slot, true);
}

double rotor_lower_bound(const chain& c, std::size_t budget_bytes, std::size_t memory_slots) {
  const chain_model m = detail::make_model(c, "rotor_lower_bound");
  const std::size_t slot = slot_size("rotor_lower_bound", m, budget_bytes, memory_slots);
  if (store_all_fits(c, m, budget_bytes)) return m.base_cost;
  // Rounded down, every byte sum that fits the budget also fits floor(budget / slot) slots.
  const std::size_t slots = budget_bytes / slot;
  const chain_model q = detail::discretise(m, slot, detail::rounding::down);
  if (q.x[0] > slots) return inf;
  return cost_table(q, slots).cost(1, m.length + 1, slots - q.x[0]);
}

}  // namespace spillway::eviction
