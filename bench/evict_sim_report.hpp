// evict_sim_report: what spillway-evict-sim measured, and its three forms: a table, JSON, and an
// SVG line plot (budget ratio on x, overhead on y, one line per policy and mode plus rotor), written
// by hand so the tool needs no plotting library.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "evict_sim_chain.hpp"
#include "evict_sim_run.hpp"
#include "op_trace.hpp"

namespace spillway::evsim {

struct budget_point {
  double ratio = 0;
  std::size_t budget = 0;
  run_result result;
};

struct series {
  std::string policy;
  engine_mode mode = engine_mode::hybrid;
  std::vector<budget_point> points;  // one per ratio, in --budgets order
  std::string label() const { return policy + "/" + to_string(mode); }
};

struct rotor_series {
  chain_model chain;                 // every valid cut
  chain_model saved_chain;           // only cuts at buffers the backward reads (cut_rule)
  bool computed = false;             // false: not a chain, or too many stages
  std::string why;                   // when !computed
  std::size_t min_budget = 0;        // rotor_min_device_budget
  std::vector<rotor_point> at;       // one per ratio
};

struct trace_report {
  std::string name;                  // file name or synth spec
  op_trace::trace_data const* trace = nullptr;
  op_trace::trace_summary summary;
  run_result baseline;               // no engine, no budget
  std::vector<double> ratios;
  std::vector<series> runs;
  rotor_series rotor;

  std::size_t peak() const noexcept { return baseline.peak_reserved; }
  // time / baseline - 1 for a run; extra compute; stalls (time - baseline - extra compute).
  double overhead(const run_result& r) const;
  double stall_ns(const run_result& r) const;
};

// For chain traces: at each ratio whose budget is at least rotor's minimum, the best drop-only
// run's time added to the baseline (its recomputes, and the stalls of compaction's moves) over
// rotor's extra compute. met: <= 1.15 everywhere (an OOM, an error or a corrupt run there is
// none). Empty when rotor was not computed or no drop-only run was asked for.
// The chain target at one ratio. rotor's plan rounds sizes up to its memory slots, so its extra
// compute may exceed the true optimum's; rotor_bound_ns (sizes rounded down) may not be reached
// by any persistent schedule. The true optimum lies between: factor_vs_bound is the stricter
// figure. Where the slot grid found no plan (rotor_fallback: the least-memory schedule, not an
// optimum) the target is judged against the bound; elsewhere against the plan.
struct chain_target {
  double ratio = 0;
  bool rotor_feasible = false;
  double rotor_extra_ns = 0;
  double rotor_bound_ns = 0;
  bool rotor_fallback = false;
  std::string best;          // label of the best drop-only run ("" if none finished)
  double best_added_ns = 0;  // its time - the baseline's
  double factor = 0;         // best / rotor (1 when both are 0; inf when rotor is 0 and best is not)
  double factor_vs_bound = 0;  // best / rotor_bound_ns, the same way
  bool met = false;          // factor (factor_vs_bound for a fallback) <= the limit
  // Only where rotor's model holds what the engine holds: not when the backward produces
  // parameters (gradients) that rotor's model leaves out (chain_model::backward_param_bytes);
  // rotor's figure is then a lower bound the engine cannot reach, reported but not judged.
  bool judged = true;
};
std::vector<chain_target> chain_targets(const trace_report& r, double limit = 1.15);

void print_table(std::ostream& out, const std::vector<trace_report>& reports, const std::string& device_line);
void write_json(bench::json_writer& j, const std::vector<trace_report>& reports);
void write_svg(const std::string& path, const std::vector<trace_report>& reports);

}  // namespace spillway::evsim
