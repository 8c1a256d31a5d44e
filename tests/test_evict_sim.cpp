// test_evict_sim: the eviction simulator's parts (bench/evict_sim_chain.hpp, evict_sim_run.hpp).
//
// It proves: an MLP trace is a chain of one stage per layer plus the loss, with rotor's sizes, costs
// and fixed bytes, and a U-Net (long skips) has fewer stages than ops; a linear + relu chain (the
// linear's output read only by the relu) has a stage per op, or per layer when only cuts at
// buffers the backward reads count, and rotor's better plan comes from the latter; and a replay under a budget
// recomputes (drop), copies (spill) or both (hybrid) and brings every input back with the bytes it
// had (the kernels check signatures), stays within the budget, is never faster than the replay
// without a budget — which takes exactly the sum of the op durations — and reports an
// out-of-memory as a failed run; and the chain target holds only drop-only runs to rotor's
// optimum, counting an out-of-memory one as a miss.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "evict_sim_chain.hpp"
#include "evict_sim_report.hpp"
#include "evict_sim_run.hpp"
#include "op_trace_builder.hpp"
#include "op_trace.hpp"
#include "op_trace_synth.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::op_trace;

TEST_CASE("rotor's fixed memory: the parameter bytes alive in the forward, not what the backward makes") {
  // w1 (4 KiB) lives from the start; the backward replaces it twice in place (an optimizer's
  // new versions w2, then w3), each old version released after the op that wrote the new one.
  // The sum of all three is no schedule's memory; the two alive at once in the backward would
  // give rotor less room than the engine has in the forward. rotor is charged w1 alone: its room
  // is at least the engine's throughout, and its figures stay a lower bound.
  const trace_data t = parse_op_trace("# spillway-op-trace v1 model=tiny source=hand\n"
                                      "b 1 4096 param\n"
                                      "b 2 1024\n"
                                      "b 3 1024\n"
                                      "b 4 4096 param\n"
                                      "b 5 4096 param\n"
                                      "o fwd 100 in 1 out 2\n"
                                      "o loss 100 in 2 out 3\n"
                                      "phase backward\n"
                                      "o step_a 100 in 1 2 3 out 4\n"
                                      "f 1\n"
                                      "f 2\n"
                                      "f 3\n"
                                      "o step_b 100 in 4 out 5\n"
                                      "f 4\n",
                                      "fixed.optrace");
  const evsim::chain_model c = evsim::extract_chain(t, compute_liveness(t));
  REQUIRE_MESSAGE(c.ok, c.why);
  CHECK(c.fixed_bytes == 4096);
  CHECK(c.backward_param_bytes == 2 * 4096);  // w2 and w3, at step_b: what rotor leaves out
}

TEST_CASE("an MLP trace is a chain: one stage per layer plus the loss") {
  synth_options o;
  o.model = "mlp";
  o.layers = 5;
  o.batch = 1024;
  const trace_data t = synthesize(o);
  const evsim::chain_model c = evsim::extract_chain(t, compute_liveness(t));
  REQUIRE(c.ok);
  REQUIRE(c.chain.stages.size() == 6);
  std::size_t params = 0;
  for (const buffer& b : t.buffers) params += b.param ? size_classes::round_size(b.bytes) : 0;
  CHECK(c.fixed_bytes == params);
  CHECK(c.backward_param_bytes == 0);  // gradients preallocated: rotor's model is exact
  for (std::size_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    const std::uint32_t x = t.ops[i].outputs.front();
    CHECK(c.chain.stages[i].x_bytes == size_classes::round_size(t.buffers[x].bytes));
    CHECK(c.chain.stages[i].xbar_bytes == c.chain.stages[i].x_bytes);
    CHECK(c.chain.stages[i].forward_cost == static_cast<double>(t.ops[i].duration_ns));
    CHECK(c.chain.stages[i].forward_overhead_bytes == 0);
  }
  const evsim::rotor_point all = evsim::rotor_at(c, std::size_t{1} << 34);
  CHECK(all.feasible);
  CHECK(all.extra_cost_ns == 0);
  CHECK_FALSE(evsim::rotor_at(c, c.fixed_bytes).feasible);
  CHECK(evsim::rotor_min_device_budget(c) > c.fixed_bytes);

  synth_options u;
  u.model = "unet";
  u.layers = 2;
  u.batch = 1;
  const trace_data ut = synthesize(u);
  const evsim::chain_model uc = evsim::extract_chain(ut, compute_liveness(ut));
  CHECK(uc.ok);  // cuts before the first skip and after the last one only
  CHECK(uc.chain.stages.size() < ut.backward_begin());
}

TEST_CASE("cuts at buffers only the next op reads: rotor plans both decompositions, the better counts") {
  // linear -> relu, eight layers, as PyTorch records them: a linear's backward reads its input, a
  // relu's its output; the linear's output z is read by its relu only.
  op_trace::step_builder s(/*bytes_per_ns=*/100.0, /*min_op_ns=*/1000);
  constexpr std::uint64_t act = 4u << 20;
  op_trace::step_builder::value x = s.input(act);
  for (int i = 0; i < 8; ++i) {
    const auto w = s.weight(1u << 20);
    const auto z = s.op1("linear" + std::to_string(i), 100000, {x, w}, act, op_trace::saved::inputs, 200000);
    x = s.op1("relu" + std::to_string(i), 5000, {z}, act, op_trace::saved::outputs, 5000);
  }
  const trace_data t = s.finish(x, "linear-relu", "test");
  const liveness live = compute_liveness(t);
  const evsim::chain_model every = evsim::extract_chain(t, live, evsim::cut_rule::every_cut);
  const evsim::chain_model saved = evsim::extract_chain(t, live, evsim::cut_rule::saved_cuts);
  REQUIRE(every.ok);
  REQUIRE(saved.ok);
  // The first linear reads parameters only (the batch and W), so its z counts as a constant
  // (fixed bytes): every other op ends a stage, 15 in all.
  CHECK(every.chain.stages.size() == 15);
  CHECK(saved.chain.stages.size() == 8);  // after every relu: z is a transient of its layer
  for (std::size_t i = 0; i < saved.chain.stages.size(); ++i) {
    const eviction::chain_stage& st = saved.chain.stages[i];
    CAPTURE(i);
    CHECK(st.xbar_bytes == size_classes::round_size(act));
    if (i > 0) CHECK(st.forward_overhead_bytes == size_classes::round_size(act));  // z, during its relu
  }
  // Every-cut rotor holds each z it saves until its backward: over a range of budgets, planning
  // both and taking the better is sometimes cheaper than every-cut alone, never dearer.
  const std::vector<const evsim::chain_model*> both{&every, &saved};
  const std::size_t least = evsim::best_rotor_min_device_budget(both);
  CHECK(least == std::min(evsim::rotor_min_device_budget(every), evsim::rotor_min_device_budget(saved)));
  int saved_better = 0;
  for (std::size_t budget = least; budget < least + (48u << 20); budget += 1u << 20) {
    CAPTURE(budget);
    const evsim::rotor_point e = evsim::rotor_at(every, budget), v = evsim::rotor_at(saved, budget);
    const evsim::rotor_point best = evsim::best_rotor_at(both, budget);
    REQUIRE(best.feasible);
    if (e.feasible) CHECK(best.extra_cost_ns <= e.extra_cost_ns);
    if (v.feasible) CHECK(best.extra_cost_ns <= v.extra_cost_ns);
    if (v.feasible && (!e.feasible || v.extra_cost_ns < e.extra_cost_ns)) {
      ++saved_better;
      CHECK(best.stages == saved.chain.stages.size());
    }
  }
  CHECK(saved_better > 0);
}

TEST_CASE("a replay under a budget brings every input back with its bytes") {
  synth_options o;
  o.model = "mlp";
  o.layers = 8;
  o.batch = 16384;
  o.width = 256;
  const trace_data t = synthesize(o);
  const liveness l = compute_liveness(t);
  evsim::run_config c;
  c.mode = evsim::engine_mode::none;
  c.verify = true;
  const evsim::run_result base = evsim::replay(t, l, c);
  REQUIRE(base.ok);
  CHECK(base.total_ns == summarize(t).total_duration_ns);
  CHECK(base.verify_mismatches == 0);
  CHECK(base.verify_checks > 0);
  for (const auto mode : {evsim::engine_mode::drop_only, evsim::engine_mode::hybrid, evsim::engine_mode::spill_only}) {
    CAPTURE(evsim::to_string(mode));
    c.mode = mode;
    c.policy = "dtr";
    c.budget = base.peak_reserved * 8 / 10;
    const evsim::run_result r = evsim::replay(t, l, c);
    REQUIRE_MESSAGE(r.ok, r.failure);
    CHECK(r.verify_mismatches == 0);
    CHECK(r.peak_reserved <= c.budget);
    CHECK(r.total_ns >= base.total_ns);
    CHECK(r.pressure_evictions() > 0);
    if (mode == evsim::engine_mode::drop_only) CHECK(r.engine.recomputes > 0);
    if (mode == evsim::engine_mode::spill_only) {
      CHECK(r.engine.spills > 0);
      CHECK(r.engine.recomputes == 0);
      CHECK(r.engine.bytes_restored > 0);
    }
  }
  c.mode = evsim::engine_mode::drop_only;
  c.budget = 1 << 20;  // below the parameters
  const evsim::run_result oom = evsim::replay(t, l, c);
  CHECK_FALSE(oom.ok);
  CHECK(oom.failure.find("out of memory") != std::string::npos);
}

TEST_CASE("the chain target: drop-only runs only, by the time they add, an out-of-memory one a miss") {
  evsim::trace_report r;
  r.baseline.total_ns = 10000;
  r.ratios = {0.5, 0.9};
  r.rotor.computed = true;
  r.rotor.at.resize(2);
  r.rotor.at[0].feasible = true;
  r.rotor.at[0].extra_cost_ns = 1000;
  r.rotor.at[1].feasible = true;  // rotor needs no recompute there
  // A run that added `added_ns` to the baseline's time, `stall_ns` of it not recomputing.
  const auto run = [&r](bool ok, double added_ns, double stall_ns = 0) {
    evsim::budget_point p;
    p.result.ok = ok;
    p.result.total_ns = r.baseline.total_ns + static_cast<std::uint64_t>(added_ns);
    p.result.engine.recompute_cost_ns = added_ns - stall_ns;
    return p;
  };

  SUBCASE("no drop-only run: no target to report") {
    r.runs.push_back({"lru", evsim::engine_mode::spill_only, {run(true, 0), run(true, 0)}});
    CHECK(evsim::chain_targets(r).empty());
  }
  SUBCASE("every drop-only run out of memory: a miss, with no best run") {
    r.runs.push_back({"dtr", evsim::engine_mode::drop_only, {run(false, 0), run(false, 0)}});
    const auto t = evsim::chain_targets(r);
    REQUIRE(t.size() == 2);
    CHECK(t[0].best.empty());
    CHECK_FALSE(t[0].met);
  }
  SUBCASE("the cheapest drop-only run counts; a hybrid run does not") {
    r.runs.push_back({"dtr", evsim::engine_mode::drop_only, {run(true, 1200), run(true, 0)}});
    r.runs.push_back({"dtr-frag", evsim::engine_mode::drop_only, {run(true, 1100), run(true, 50)}});
    r.runs.push_back({"dtr", evsim::engine_mode::hybrid, {run(true, 0), run(true, 0)}});
    const auto t = evsim::chain_targets(r);
    REQUIRE(t.size() == 2);
    CHECK(t[0].best == "dtr-frag/drop");
    CHECK(t[0].factor == doctest::Approx(1.1));
    CHECK(t[0].met);
    CHECK(t[1].best == "dtr/drop");
    CHECK(t[1].factor == 1);  // both need nothing
    CHECK(t[1].met);
    CHECK_FALSE(evsim::chain_targets(r, 1.05)[0].met);
  }
  SUBCASE("the bound is reported; a fallback plan is no optimum: judged against the bound") {
    r.rotor.at[0].lower_bound_extra_ns = 800;
    r.runs.push_back({"dtr", evsim::engine_mode::drop_only, {run(true, 1100), run(true, 0)}});
    auto t = evsim::chain_targets(r);
    CHECK(t[0].rotor_bound_ns == 800);
    CHECK(t[0].factor_vs_bound == doctest::Approx(1.375));
    CHECK(t[0].met);  // 1.1x the plan
    r.rotor.at[0].least_memory_fallback = true;
    t = evsim::chain_targets(r);
    CHECK(t[0].rotor_fallback);
    CHECK_FALSE(t[0].met);  // 1.375x the bound
  }
  SUBCASE("a run's stalls count with its recomputes: rotor's schedule has none") {
    // 1,000 ns of recompute, as rotor, and 200 ns of copies compaction made to avoid more.
    r.runs.push_back({"dtr", evsim::engine_mode::drop_only, {run(true, 1200, 200), run(true, 0)}});
    const auto t = evsim::chain_targets(r);
    CHECK(t[0].best_added_ns == 1200);
    CHECK(t[0].factor == doctest::Approx(1.2));
    CHECK_FALSE(t[0].met);
  }
  SUBCASE("not judged where rotor leaves out gradients the backward makes") {
    r.runs.push_back({"dtr", evsim::engine_mode::drop_only, {run(true, 1000), run(true, 0)}});
    CHECK(evsim::chain_targets(r)[0].judged);
    r.rotor.chain.backward_param_bytes = 4096;
    const auto t = evsim::chain_targets(r);
    CHECK_FALSE(t[0].judged);
    CHECK(t[0].factor == doctest::Approx(1.0));  // reported all the same
  }
  SUBCASE("a corrupt run (a verified read came back wrong) counts as none") {
    evsim::budget_point corrupt = run(true, 900);
    corrupt.result.verify_mismatches = 1;
    r.runs.push_back({"dtr", evsim::engine_mode::drop_only, {corrupt, run(true, 0)}});
    r.runs.push_back({"dtr-frag", evsim::engine_mode::drop_only, {run(true, 1400), run(true, 0)}});
    const auto t = evsim::chain_targets(r);
    CHECK(t[0].best == "dtr-frag/drop");
    CHECK_FALSE(t[0].met);
  }
}
