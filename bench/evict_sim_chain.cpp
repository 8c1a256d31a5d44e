// evict_sim_chain: an operator trace as a rotor chain. The rules are in evict_sim_chain.hpp.
#include "evict_sim_chain.hpp"

#include <limits>

#include <cmath>

#include <algorithm>
#include <chrono>

#include "spillway/size_classes.hpp"

namespace spillway::evsim {

using op_trace::never;

chain_model extract_chain(const op_trace::trace_data& t, const op_trace::liveness& l, cut_rule rule) {
  chain_model c;
  const std::size_t forward = t.backward_begin();
  const std::size_t n = t.buffers.size();
  if (forward == t.ops.size()) {
    c.why = "no `phase backward` marker";
    return c;
  }
  if (forward < 2) {
    c.why = "fewer than two forward ops";
    return c;
  }
  const auto rounded = [&](std::uint32_t b) { return size_classes::round_size(t.buffers[b].bytes); };

  // Buffers the backward reads; constants; the last forward op that reads each buffer.
  std::vector<bool> read_backward(n, false), constant(n, false);
  std::vector<std::size_t> last_forward_read(n, never);
  for (std::size_t k = forward; k < t.ops.size(); ++k) {
    for (std::uint32_t b : t.ops[k].inputs) read_backward[b] = true;
  }
  for (std::size_t k = 0; k < forward; ++k) {
    const op_trace::op& o = t.ops[k];
    bool from_constants = true;
    for (std::uint32_t b : o.inputs) {
      from_constants = from_constants && (t.buffers[b].param || constant[b]);
      last_forward_read[b] = k;
    }
    for (std::uint32_t b : o.outputs) constant[b] = !t.buffers[b].param && from_constants && !read_backward[b];
  }
  const auto activation = [&](std::uint32_t b) {  // a forward buffer that rotor's model tracks
    return !t.buffers[b].param && !constant[b] && l.produced_by[b] != never && l.produced_by[b] < forward;
  };

  // Crossing counts: buffer b crosses the cuts after ops produced_by[b] .. last_forward_read[b] - 1.
  std::vector<long long> count(forward + 1, 0);
  std::vector<unsigned long long> id_sum(forward + 1, 0);
  for (std::uint32_t b = 0; b < n; ++b) {
    if (!activation(b) || last_forward_read[b] == never || last_forward_read[b] <= l.produced_by[b]) continue;
    count[l.produced_by[b]] += 1;
    count[last_forward_read[b]] -= 1;
    id_sum[l.produced_by[b]] += b;
    id_sum[last_forward_read[b]] -= b;
  }
  std::vector<std::size_t> ends;        // last op of each stage
  std::vector<std::uint32_t> x_of;      // the buffer crossing each stage's end (all but the last)
  long long running = 0;
  unsigned long long running_id = 0;
  for (std::size_t p = 0; p + 1 < forward; ++p) {
    running += count[p];
    running_id += id_sum[p];
    if (running == 1 && (rule == cut_rule::every_cut || read_backward[static_cast<std::uint32_t>(running_id)])) {
      ends.push_back(p);
      x_of.push_back(static_cast<std::uint32_t>(running_id));
    }
  }
  ends.push_back(forward - 1);
  if (ends.size() < 2) {
    c.why = "no valid cut: two or more activations cross every point of the forward";
    return c;
  }
  const std::size_t stages = ends.size();
  std::vector<std::size_t> stage_of_op(forward);
  for (std::size_t s = 0, k = 0; s < stages; ++s) {
    for (; k <= ends[s]; ++k) stage_of_op[k] = s;
  }

  c.chain.stages.resize(stages);
  c.chain.input_bytes = 0;
  c.stage_last_op = ends;
  std::vector<bool> in_xbar(n, false);
  // x_i, and for the last stage the non-parameter outputs of the last forward op (the loss).
  for (std::size_t s = 0; s + 1 < stages; ++s) {
    c.chain.stages[s].x_bytes = rounded(x_of[s]);
    in_xbar[x_of[s]] = true;
  }
  for (std::uint32_t b : t.ops[forward - 1].outputs) {
    if (!activation(b)) continue;
    c.chain.stages.back().x_bytes += rounded(b);
    in_xbar[b] = true;
  }
  if (c.chain.stages.back().x_bytes == 0) {
    c.why = "the last forward op writes no activation (the loss)";
    return c;
  }
  for (std::size_t s = 0; s < stages; ++s) c.chain.stages[s].xbar_bytes = c.chain.stages[s].x_bytes;
  // Saved-for-backward buffers join their stage's xbar; the others are transients.
  std::vector<long long> transient(forward + 1, 0);
  for (std::uint32_t b = 0; b < n; ++b) {
    if (!activation(b) || in_xbar[b]) continue;
    const std::size_t s = stage_of_op[l.produced_by[b]];
    if (read_backward[b]) {
      c.chain.stages[s].xbar_bytes += rounded(b);
      in_xbar[b] = true;
    } else {
      const std::size_t until = last_forward_read[b] == never ? l.produced_by[b] : last_forward_read[b];
      transient[l.produced_by[b]] += static_cast<long long>(rounded(b));
      transient[until + 1] -= static_cast<long long>(rounded(b));
    }
  }
  long long live_transient = 0;
  for (std::size_t k = 0; k < forward; ++k) {
    live_transient += transient[k];
    eviction::chain_stage& st = c.chain.stages[stage_of_op[k]];
    st.forward_cost += static_cast<double>(t.ops[k].duration_ns);
    st.forward_overhead_bytes = std::max(st.forward_overhead_bytes, static_cast<std::size_t>(live_transient));
  }
  // Backward costs: the latest stage whose activations the op reads, else the previous op's stage.
  std::size_t current = stages - 1;
  for (std::size_t k = forward; k < t.ops.size(); ++k) {
    std::size_t latest = never;
    for (std::uint32_t b : t.ops[k].inputs) {
      if (activation(b)) {
        const std::size_t s = stage_of_op[l.produced_by[b]];
        latest = latest == never ? s : std::max(latest, s);
      }
    }
    if (latest != never) current = latest;
    c.chain.stages[current].backward_cost += static_cast<double>(t.ops[k].duration_ns);
  }
  // Fixed memory: the most bytes of parameters and constants alive at once in the forward, each
  // from its producer (or the start) to its release (or the end). rotor holds it for the whole
  // step: gradients the backward produces are not charged (they would lower rotor's room in the
  // backward only, which its model cannot express), so rotor's room is at least the engine's
  // throughout and its figures stay a lower bound. Charging them for the whole step (the most
  // alive at any time) gave rotor less room than the engine in the forward, and flattered the
  // engine on recorded traces (the torch MLP: 128 of its 288 MiB).
  std::vector<long long> fixed_delta(t.ops.size() + 1, 0), backward_delta(t.ops.size() + 1, 0);
  for (std::uint32_t b = 0; b < n; ++b) {
    if (!t.buffers[b].param && !constant[b]) continue;
    const std::size_t from = l.produced_by[b] == never ? 0 : l.produced_by[b];
    const std::size_t to = l.dies_after[b] == never ? t.ops.size() - 1 : l.dies_after[b];
    std::vector<long long>& delta = from >= forward ? backward_delta : fixed_delta;
    delta[from] += static_cast<long long>(rounded(b));
    delta[to + 1] -= static_cast<long long>(rounded(b));
  }
  long long fixed_live = 0, backward_live = 0;
  for (std::size_t k = 0; k < t.ops.size(); ++k) {
    fixed_live += fixed_delta[k];
    backward_live += backward_delta[k];
    if (k < forward) c.fixed_bytes = std::max(c.fixed_bytes, static_cast<std::size_t>(fixed_live));
    c.backward_param_bytes = std::max(c.backward_param_bytes, static_cast<std::size_t>(backward_live));
  }
  c.ok = true;
  return c;
}

rotor_point rotor_at(const chain_model& c, std::size_t device_budget, std::size_t memory_slots) {
  rotor_point r;
  if (!c.ok || device_budget <= c.fixed_bytes) return r;
  const auto start = std::chrono::steady_clock::now();
  const eviction::rotor_plan plan = eviction::plan_rotor(c.chain, device_budget - c.fixed_bytes, memory_slots);
  r.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.feasible = plan.feasible;
  if (!plan.feasible) return r;
  r.extra_cost_ns = plan.extra_cost;
  r.total_cost_ns = plan.total_cost;
  r.peak_bytes = plan.peak_bytes + c.fixed_bytes;
  r.least_memory_fallback = plan.least_memory_fallback;
  r.stages = c.chain.stages.size();
  const double bound_total = eviction::rotor_lower_bound(c.chain, device_budget - c.fixed_bytes, memory_slots);
  const double base = plan.total_cost - plan.extra_cost;
  r.lower_bound_extra_ns = std::isfinite(bound_total) ? std::max(0.0, bound_total - base) : 0.0;
  r.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

rotor_point best_rotor_at(const std::vector<const chain_model*>& models, std::size_t device_budget,
                          std::size_t memory_slots) {
  rotor_point best;
  double seconds = 0;
  double bound = std::numeric_limits<double>::infinity();
  for (const chain_model* c : models) {
    const rotor_point p = rotor_at(*c, device_budget, memory_slots);
    seconds += p.plan_seconds;
    if (!p.feasible) continue;
    bound = std::min(bound, p.lower_bound_extra_ns);
    if (!best.feasible || p.extra_cost_ns < best.extra_cost_ns) best = p;
  }
  best.plan_seconds = seconds;
  if (best.feasible) best.lower_bound_extra_ns = bound;
  return best;
}

std::size_t best_rotor_min_device_budget(const std::vector<const chain_model*>& models) {
  std::size_t least = 0;
  for (const chain_model* c : models) {
    if (!c->ok) continue;
    const std::size_t m = rotor_min_device_budget(*c);
    if (least == 0 || m < least) least = m;
  }
  return least;
}

std::size_t rotor_min_device_budget(const chain_model& c) {
  return c.ok ? eviction::rotor_min_budget(c.chain) + c.fixed_bytes : 0;
}

}  // namespace spillway::evsim
