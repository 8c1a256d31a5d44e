// test_engine_thrashing: Note [Thrashing bound] (docs/eviction.md).
//
// It proves: a caller's pin that would recompute more than max_recompute_factor times the cost of
// the whole live lineage fails with out_of_memory that says it is thrashing and names the factor,
// before the node that would pass the bound runs, and without a plan's retry of that node (which
// lets its held outputs go for a failed allocation); nothing is lost: the nodes it ran leave their
// outputs resident and whole, the others stay dropped, no pin is left held, and a later pin
// finishes the work; the count starts again at each caller's pin (two pins that each stay under
// the bound both succeed); the number of nodes a pin runs is bounded the same way, so nodes that
// cost nothing are bounded too; 0 sets no bound; a negative, NaN or infinite factor is refused with
// invalid_argument naming the value; recompute plans nested past max_nested_plans fail as
// thrashing too, nothing lost, and a max_nested_plans of 0 is refused.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// A chain s -> x1 -> ... -> x8 of 16 KiB buffers, each node costing 1 us (the lineage: 8 us)
// unless told, with x1..x8 dropped.
struct dropped_chain {
  engine_env env;
  lineage_graph g{env};
  std::vector<buffer_id> ids;

  explicit dropped_chain(double factor, double cost_ns = 1000) : env(options(factor)) {
    ids.push_back(g.source(16 * KiB));
    for (int i = 0; i < 8; ++i) ids.push_back(g.node({ids.back()}, {16 * KiB}, {}, cost_ns)[0]);
    env.sim->run_until_idle();
    for (std::size_t i = 1; i < ids.size(); ++i) drop(env.eng(), ids[i]);
  }
  static engine_options options(double factor) {
    engine_options o;
    o.engine.max_recompute_factor = factor;
    return o;
  }
};

}  // namespace

TEST_CASE("a pin that would recompute past max_recompute_factor x the lineage fails as thrashing") {
  dropped_chain c(0.5);  // at most 4 us of recompute per pin
  try {
    (void)c.env.eng().pin(c.ids[8]);
    FAIL("pin returned");
  } catch (const out_of_memory& e) {
    CHECK_MESSAGE(contains(e.what(), "thrashing"), e.what());
    CHECK_MESSAGE(contains(e.what(), "max_recompute_factor 0.5"), e.what());
    CHECK_MESSAGE(contains(e.what(), "raise the budget"), e.what());
  }
  // x1..x4 ran (4 us), x5 would have passed the bound: nothing else changed, and no pin is held.
  CHECK(c.env.eng().stats().recomputes == 4);
  for (std::size_t i = 1; i <= 4; ++i) CHECK(c.env.eng().state(c.ids[i]) == buffer_state::resident);
  for (std::size_t i = 5; i <= 8; ++i) CHECK(c.env.eng().state(c.ids[i]) == buffer_state::dropped);
  CHECK(c.env.eng().stats().pinned_bytes == 0);
  // Not a failed allocation: the plan did not let its held output (x4) go to try x5 again.
  CHECK(c.env.eng().stats().plan_holds_released == 0);
  // The next pin starts its own count: x5..x8 (4 us) fit it, and every byte is right.
  c.g.expect(c.ids[8]);
  CHECK(c.env.eng().stats().recomputes == 8);
  for (buffer_id id : c.ids) c.g.expect(id);
  c.env.sim->run_until_idle();
  c.env.check_clean();
}

TEST_CASE("nodes that cost nothing are bounded by their number") {
  dropped_chain c(0.5, 0);  // at most 4 of the 8 nodes per pin
  try {
    (void)c.env.eng().pin(c.ids[8]);
    FAIL("pin returned");
  } catch (const out_of_memory& e) {
    CHECK_MESSAGE(contains(e.what(), "thrashing"), e.what());
    CHECK_MESSAGE(contains(e.what(), "this pin has run 4 lineage nodes"), e.what());
    CHECK_MESSAGE(contains(e.what(), "(8 nodes, 0 ms)"), e.what());
  }
  CHECK(c.env.eng().stats().recomputes == 4);
  CHECK(c.env.eng().stats().pinned_bytes == 0);
  c.g.expect(c.ids[8]);  // a pin of its own: x5..x8
  CHECK(c.env.eng().stats().recomputes == 8);
  c.env.sim->run_until_idle();
  c.env.check_clean();
}

TEST_CASE("the recompute count starts again at every caller's pin") {
  dropped_chain c(0.5);
  c.g.expect(c.ids[4]);  // x1..x4: 4 us, at the bound
  c.g.expect(c.ids[8]);  // x5..x8: 4 us more, in a pin of its own
  CHECK(c.env.eng().stats().recomputes == 8);
  c.env.sim->run_until_idle();
  c.env.check_clean();
}

TEST_CASE("max_recompute_factor 0 sets no bound") {
  dropped_chain c(0);
  c.g.expect(c.ids[8]);
  CHECK(c.env.eng().stats().recomputes == 8);
  c.env.sim->run_until_idle();
  c.env.check_clean();
}

TEST_CASE("a negative, NaN or infinite max_recompute_factor is refused, naming it") {
  for (const double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    try {
      engine_env env(dropped_chain::options(bad));
      FAIL("the engine was made");
    } catch (const invalid_argument& e) {
      CHECK_MESSAGE(contains(e.what(), "max_recompute_factor is"), e.what());
      CHECK_MESSAGE(contains(e.what(), "expected a finite number >= 0"), e.what());
    }
  }
}

TEST_CASE("recompute plans nested past max_nested_plans fail as thrashing, nothing lost") {
  // held_outputs_graph: the plan for x4 lets x1 go to fit k's output, and h brings it back with a
  // plan inside the first. With max_nested_plans 1 that is thrashing.
  engine_options o;
  o.engine.allow_spill = false;
  o.engine.max_nested_plans = 1;
  engine_env env(o);
  lineage_graph g(env);
  const std::vector<buffer_id> x = held_outputs_graph(env, g);
  const buffer_id x4 = x[4];
  try {
    (void)env.eng().pin(x4);
    FAIL("pin returned");
  } catch (const out_of_memory& e) {
    CHECK_MESSAGE(contains(e.what(), "thrashing"), e.what());
    CHECK_MESSAGE(contains(e.what(), "max_nested_plans 1"), e.what());
    CHECK_MESSAGE(contains(e.what(), "node 'n0'"), e.what());  // f, for x1
  }
  CHECK(env.eng().stats().plan_holds_released == 1);
  CHECK(env.eng().stats().pinned_bytes == 0);
  CHECK(env.eng().state(x4) == buffer_state::dropped);
  // Nothing lost: with room, every buffer comes back whole.
  env.alloc->set_budget(std::numeric_limits<std::size_t>::max());
  for (buffer_id id : x) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("max_nested_plans 0 is refused, naming it") {
  engine_options o;
  o.engine.max_nested_plans = 0;
  try {
    engine_env env(o);
    FAIL("the engine was made");
  } catch (const invalid_argument& e) {
    CHECK_MESSAGE(contains(e.what(), "max_nested_plans is 0"), e.what());
    CHECK_MESSAGE(contains(e.what(), "expected >= 1"), e.what());
  }
}
