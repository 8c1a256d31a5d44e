// test_evict_sim: the eviction simulator's parts (bench/evict_sim_chain.hpp, evict_sim_run.hpp).
//
// It proves: an MLP trace is a chain of one stage per layer plus the loss, with rotor's sizes, costs
// and fixed bytes, and a U-Net (long skips) has fewer stages than ops; and a replay under a budget
// recomputes (drop), copies (spill) or both (hybrid) and brings every input back with the bytes it
// had (the kernels check signatures), stays within the budget, is never faster than the replay
// without a budget — which takes exactly the sum of the op durations — and reports an
// out-of-memory as a failed run.
#include <doctest/doctest.h>

#include <cstddef>
#include <string>

#include "evict_sim_chain.hpp"
#include "evict_sim_run.hpp"
#include "op_trace.hpp"
#include "op_trace_synth.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::op_trace;

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
