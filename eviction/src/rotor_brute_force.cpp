// rotor_brute_force: the cheapest valid schedule by exhaustive search, to check plan_rotor.
//
// A state is what the simulator tracks: for each x_i (i >= 1) absent / a plain copy not yet kept /
// a kept checkpoint / inside xbar_i, and the next backward. Ops move between states with a cost and
// a peak; Dijkstra over the states whose every op peak fits the budget finds the cheapest schedule.
// The state graph is acyclic (each op either advances the backward or moves values up the chain),
// so zero costs are fine. Two ops are left out because another op does the same for the same cost:
// F_n reading a value inside xbar (drops nothing, like F_ck) and plain forwards whose output nothing
// can read any more (the simulator rejects those).
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <vector>

#include "rotor_model.hpp"
#include "spillway/errors.hpp"

namespace spillway::eviction {
namespace {

constexpr int max_stages = 8;
constexpr double inf = std::numeric_limits<double>::infinity();
enum held : unsigned { none = 0, temp = 1, kept = 2, all = 3 };

// key = next backward (4 bits) | 2 bits per value x_1..x_L.
struct state {
  std::uint32_t key;
  int next() const { return static_cast<int>(key & 15u); }
  unsigned at(int i) const { return (key >> (4 + 2 * (i - 1))) & 3u; }  // i >= 1
  void set_next(int n) { key = (key & ~15u) | static_cast<std::uint32_t>(n); }
  void set(int i, unsigned h) {
    const int shift = 4 + 2 * (i - 1);
    key = (key & ~(3u << shift)) | (h << shift);
  }
};

struct search {
  const detail::chain_model& m;
  std::size_t budget;
  bool persistent;
  std::vector<double> dist;
  std::vector<std::uint32_t> parent;
  std::vector<schedule_op> via;

  std::size_t memory(state s) const {
    std::size_t mem = m.x[0] + m.x[s.next()];  // x[L + 1] = 0: no gradient before the loss
    for (int i = 1; i <= m.length; ++i) {
      const unsigned h = s.at(i);
      mem += h == all ? m.xbar[i] : h != none ? m.x[i] : 0;
    }
    return mem;
  }

  bool available(state s, int i) const { return i == 0 || s.at(i) != none; }
  bool plain(state s, int i) const { return i >= 1 && (s.at(i) == temp || s.at(i) == kept); }

  // Calls relax(next_state, op, cost, peak) for every op allowed in s.
  template <class Relax>
  void expand(state s, Relax relax) const {
    const int L = m.length;
    const int next = s.next();
    const std::size_t mem = memory(s);
    if (next == L + 1 && available(s, L)) {
      state n = s;
      if (plain(s, L)) n.set(L, none);
      n.set_next(L);
      relax(n, schedule_op{op_kind::loss, L}, 0.0, mem + m.x[L]);
    }
    if (next >= 1 && next <= L && s.at(next) == all && available(s, next - 1)) {
      const int i = next;
      state n = s;
      n.set(i, none);
      if (plain(s, i - 1)) n.set(i - 1, none);
      n.set_next(i - 1);
      relax(n, schedule_op{op_kind::backward, i - 1}, m.bwd_cost[i], mem + m.x[i - 1] + m.bwd_overhead[i]);
    }
    for (int i = 1; i <= std::min(next, L); ++i) {
      if (!available(s, i - 1) || s.at(i) != none) continue;
      const unsigned in = i == 1 ? kept : s.at(i - 1);
      const unsigned keep = (persistent && in == temp) ? kept : in;
      {
        state n = s;
        if (i > 1) n.set(i - 1, keep);
        n.set(i, all);
        relax(n, schedule_op{op_kind::forward_save_all, i - 1}, m.fwd_cost[i],
              mem + m.xbar[i] + m.fwd_overhead[i]);
      }
      if (next == i) continue;  // a plain x_i could only feed stages whose backward already ran
      const std::size_t peak = mem + m.x[i] + m.fwd_overhead[i];
      {
        state n = s;
        if (i > 1) n.set(i - 1, keep);
        n.set(i, temp);
        relax(n, schedule_op{op_kind::forward_checkpoint, i - 1}, m.fwd_cost[i], peak);
      }
      if (i > 1 && (in == temp || (in == kept && !persistent))) {
        state n = s;
        n.set(i - 1, none);
        n.set(i, temp);
        relax(n, schedule_op{op_kind::forward_no_save, i - 1}, m.fwd_cost[i], peak);
      }
    }
  }

  // The cheapest schedule, or an empty one (and +inf) if none fits.
  std::pair<double, std::vector<schedule_op>> run() {
    const int L = m.length;
    const std::size_t states = std::size_t{1} << (4 + 2 * L);
    dist.assign(states, inf);
    parent.assign(states, 0);
    via.assign(states, schedule_op{op_kind::loss, 0});
    using entry = std::pair<double, std::uint32_t>;
    std::priority_queue<entry, std::vector<entry>, std::greater<>> queue;
    const state start{static_cast<std::uint32_t>(L + 1)};
    if (m.x[0] > budget) return {inf, {}};
    dist[start.key] = 0;
    queue.push({0.0, start.key});
    while (!queue.empty()) {
      const auto [d, key] = queue.top();
      queue.pop();
      if (d > dist[key]) continue;
      if (state{key}.next() == 0) {  // every backward ran; nothing is left but x_0 and delta_0
        std::vector<schedule_op> ops;
        for (std::uint32_t k = key; k != start.key; k = parent[k]) ops.push_back(via[k]);
        return {d, {ops.rbegin(), ops.rend()}};
      }
      expand(state{key}, [&](state n, schedule_op op, double cost, std::size_t peak) {
        if (peak > budget) return;
        const double nd = d + cost;
        if (nd < dist[n.key]) {
          dist[n.key] = nd;
          parent[n.key] = key;
          via[n.key] = op;
          queue.push({nd, n.key});
        }
      });
    }
    return {inf, {}};
  }
};

}  // namespace

rotor_plan plan_brute_force(const chain& c, std::size_t budget_bytes, schedule_class scope) {
  const detail::chain_model m = detail::make_model(c, "plan_brute_force");
  if (m.length > max_stages)
    throw spillway::invalid_argument("plan_brute_force: the chain has " + std::to_string(m.length) +
                                     " stages; expected at most " + std::to_string(max_stages) +
                                     " (the search is exponential)");
  if (budget_bytes == 0)
    throw spillway::invalid_argument("plan_brute_force: budget_bytes is 0; expected a positive budget");
  search s{m, budget_bytes, scope == schedule_class::persistent, {}, {}, {}};
  auto [cost, ops] = s.run();
  rotor_plan plan;
  if (cost == inf) {
    plan.total_cost = plan.extra_cost = inf;
    return plan;
  }
  const schedule_simulation sim = simulate_schedule(c, ops);
  if (!sim.valid || sim.peak_bytes > budget_bytes)
    throw std::logic_error("plan_brute_force: internal error: found schedule " + describe_schedule(ops) +
                           (sim.valid ? " peaks above the budget" : " is invalid: " + sim.error));
  plan.feasible = true;
  plan.total_cost = sim.cost;
  plan.extra_cost = sim.cost - m.base_cost;
  plan.peak_bytes = sim.peak_bytes;
  plan.ops = std::move(ops);
  return plan;
}

}  // namespace spillway::eviction
