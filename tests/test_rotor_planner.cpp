// test_rotor_planner: rotor's dynamic program is optimal, feasible in real bytes, and honest.
//
// It proves, on hand-checked chains, that the simulator accounts memory as rotor_planner.hpp says
// and rejects every kind of broken schedule; on hundreds of random chains of 1..6 stages and every
// budget from below the minimum to "store everything", that plan_rotor's cost equals the exhaustive
// search's optimum over persistent schedules when sizes are multiples of the slot size, is never
// below it otherwise, and never below the optimum over all schedules; that every plan passes the
// simulator within its budget; that rotor_lower_bound (sizes rounded down) never exceeds the optimum
// and meets it when slots are exact; that feasible is false exactly below rotor_min_budget (which the
// exhaustive search confirms to the byte); that an unlimited budget stores everything; that more
// budget never costs more; that bad input is refused with a message naming the value; and that
// chains of 50 and 100 stages plan in well under a second each.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "spillway/errors.hpp"
#include "spillway/eviction/rotor_planner.hpp"

using namespace spillway::eviction;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

chain_stage stage(double uf, double ub, std::size_t x, std::size_t xbar, std::size_t fo = 0,
                  std::size_t bo = 0) {
  return chain_stage{uf, ub, x, xbar, fo, bo};
}

std::vector<schedule_op> ops_of(std::initializer_list<std::pair<op_kind, int>> list) {
  std::vector<schedule_op> ops;
  for (auto [k, s] : list) ops.push_back({k, s});
  return ops;
}

constexpr op_kind ck = op_kind::forward_checkpoint, fn = op_kind::forward_no_save,
                  fall = op_kind::forward_save_all, loss = op_kind::loss, bwd = op_kind::backward;

std::vector<schedule_op> store_all(const chain& c) {
  const int L = static_cast<int>(c.stages.size());
  std::vector<schedule_op> ops;
  for (int i = 0; i < L; ++i) ops.push_back({fall, i});
  ops.push_back({loss, L});
  for (int i = L - 1; i >= 0; --i) ops.push_back({bwd, i});
  return ops;
}

std::size_t store_all_peak(const chain& c) { return simulate_schedule(c, store_all(c)).peak_bytes; }

// Integer costs keep every sum exact, so costs compare with ==.
chain random_chain(std::mt19937_64& rng, int length, std::size_t unit, bool overheads) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  chain c;
  c.input_bytes = unit * pick(1, 6);
  for (int i = 0; i < length; ++i) {
    const std::size_t x = unit * pick(1, 8);
    c.stages.push_back(stage(pick(1, 10), pick(1, 20), x, x + unit * pick(0, 8),
                             overheads ? unit * pick(0, 3) : 0, overheads ? unit * pick(0, 3) : 0));
  }
  return c;
}

// Sizes with no common unit: discretisation rounds.
chain ragged_chain(std::mt19937_64& rng, int length) {
  auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };
  chain c;
  c.input_bytes = pick(1000, 6000);
  for (int i = 0; i < length; ++i) {
    const std::size_t x = pick(1000, 8000);
    c.stages.push_back(stage(static_cast<double>(pick(1, 10)), static_cast<double>(pick(1, 20)), x,
                             x + pick(0, 8000), pick(0, 3000), pick(0, 3000)));
  }
  return c;
}

void check_plan(const chain& c, const rotor_plan& plan, std::size_t budget) {
  INFO("plan: " << describe_schedule(plan.ops));
  REQUIRE(plan.feasible);
  const schedule_simulation sim = simulate_schedule(c, plan.ops);
  REQUIRE_MESSAGE(sim.valid, sim.error);
  CHECK(sim.persistent);
  CHECK(sim.peak_bytes <= budget);
  CHECK(sim.peak_bytes == plan.peak_bytes);
  CHECK(sim.cost == doctest::Approx(plan.total_cost));
}

}  // namespace

TEST_CASE("simulator: memory of store-all and of a recompute schedule, by hand") {
  chain c;
  c.input_bytes = 10;
  c.stages = {stage(1, 10, 4, 6, 1, 2), stage(2, 20, 3, 5, 0, 1)};

  // 10 | Fall0 +6(+1) 16 | Fall1 +5 21 | Loss +3 24 | B1 +4(+1) -5-3 20 | B0 +10(+2) -6-4 20.
  const schedule_simulation all = simulate_schedule(c, store_all(c));
  REQUIRE_MESSAGE(all.valid, all.error);
  CHECK(all.peak_bytes == 32);
  CHECK(all.cost == 33);
  CHECK(all.persistent);

  // 10 | Fck0 +4(+1) 14 | Fn1 +3 -4 13 | Loss +3 -3 13 | Fall0 +6(+1) 19 | Fall1 +5 24 | B1 ... as above.
  const auto ops = ops_of({{ck, 0}, {fn, 1}, {loss, 2}, {fall, 0}, {fall, 1}, {bwd, 1}, {bwd, 0}});
  const schedule_simulation re = simulate_schedule(c, ops);
  REQUIRE_MESSAGE(re.valid, re.error);
  CHECK(re.peak_bytes == 32);
  CHECK(re.cost == 36);

  // A small input and no overhead in B0: the peak moves to B1 (1 + 6 + 5 + 3, + x1 4, + 1).
  c.stages[0].backward_overhead_bytes = 0;
  c.input_bytes = 1;
  CHECK(simulate_schedule(c, store_all(c)).peak_bytes == 20);
  CHECK(simulate_schedule(c, ops).peak_bytes == 20);
}

TEST_CASE("simulator: rejects broken schedules and names the op") {
  chain c;
  c.input_bytes = 8;
  c.stages = {stage(1, 1, 4, 6), stage(1, 1, 4, 6), stage(1, 1, 4, 6)};
  struct bad {
    std::vector<schedule_op> ops;
    std::string error;
  };
  const std::vector<bad> cases = {
      {{}, "ends before the loss"},
      {ops_of({{fn, 0}}), "drop the chain input"},
      {ops_of({{fall, 1}}), "input x1 is not in memory"},
      {ops_of({{fall, 0}, {fall, 0}}), "already in memory"},
      {ops_of({{fall, 0}, {ck, 0}}), "already in memory"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {bwd, 2}}), "before the loss"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {loss, 5}}), "the loss is stage 3"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {loss, 3}, {bwd, 1}}),
       "out of order; the next backward is stage 2"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {loss, 3}, {bwd, 2}, {bwd, 2}}), "already ran"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {loss, 3}, {bwd, 2}, {bwd, 1}}),
       "ends before the backward of stage 0"},
      {ops_of({{fall, 0}, {fall, 1}, {ck, 2}, {loss, 3}, {bwd, 2}}), "xbar of this stage is not in memory"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {loss, 3}, {bwd, 2}, {ck, 1}}),
       "can only feed stages whose backward"},
      {ops_of({{fall, 0}, {fall, 1}, {fall, 2}, {loss, 3}, {bwd, 2}, {bwd, 1}, {bwd, 0}, {fall, 2}}),
       "backward already ran"},
      {ops_of({{ck, 0}, {fn, 1}, {fn, 2}, {loss, 3}, {fall, 2}}), "input x2 is not in memory"},
      {ops_of({{fall, 7}}), "stage out of range"},
  };
  for (const bad& b : cases) {
    INFO("schedule: " << describe_schedule(b.ops));
    const schedule_simulation sim = simulate_schedule(c, b.ops);
    CHECK_FALSE(sim.valid);
    CHECK_MESSAGE(sim.error.find(b.error) != std::string::npos, sim.error);
  }

  // A valid schedule that drops a kept checkpoint (x1, kept by Fck1) and recomputes it later.
  const auto ops = ops_of({{ck, 0},
                           {ck, 1},
                           {fn, 2},
                           {loss, 3},
                           {fn, 1},
                           {fall, 2},
                           {bwd, 2},
                           {fall, 0},
                           {fall, 1},
                           {bwd, 1},
                           {bwd, 0}});
  const schedule_simulation sim = simulate_schedule(c, ops);
  REQUIRE_MESSAGE(sim.valid, sim.error);
  CHECK_FALSE(sim.persistent);
  CHECK(sim.cost == 10);
}

TEST_CASE("plan_rotor equals the exhaustive optimum on random chains, at every budget") {
  std::mt19937_64 rng(20240611);
  int plans = 0, infeasible = 0, non_persistent_better = 0;
  for (int length = 1; length <= 6; ++length) {
    const int chains = length <= 3 ? 150 : length <= 5 ? 100 : 25;
    for (int n = 0; n < chains; ++n) {
      const std::size_t unit = std::size_t{1} << std::uniform_int_distribution<int>(0, 6)(rng);
      const chain c = random_chain(rng, length, unit, n % 2 == 1);
      const std::size_t min_budget = rotor_min_budget(c);
      const std::size_t top = store_all_peak(c);
      INFO("length " << length << " chain " << n << " unit " << unit << " min " << min_budget << " store-all "
                     << top);
      REQUIRE(min_budget % unit == 0);
      REQUIRE(min_budget <= top);

      // rotor_min_budget is the least peak of any persistent schedule, to the byte.
      CHECK(plan_brute_force(c, min_budget).feasible);
      if (min_budget > 1) CHECK_FALSE(plan_brute_force(c, min_budget - 1).feasible);

      double previous = inf;
      for (std::size_t budget = min_budget > 2 * unit ? min_budget - 2 * unit : unit; budget <= top + unit;
           budget += unit) {
        INFO("budget " << budget);
        // memory_slots = budget / unit makes the slot exactly `unit`: discretisation is exact.
        const rotor_plan plan = plan_rotor(c, budget, budget / unit);
        const rotor_plan best = plan_brute_force(c, budget, schedule_class::persistent);
        const rotor_plan any = plan_brute_force(c, budget, schedule_class::any);
        REQUIRE(plan.feasible == best.feasible);
        CHECK(plan.feasible == (budget >= min_budget));
        CHECK(any.feasible >= best.feasible);
        if (!plan.feasible) {
          ++infeasible;
          CHECK(plan.total_cost == inf);
          CHECK(plan.ops.empty());
          continue;
        }
        ++plans;
        INFO("brute force: " << describe_schedule(best.ops));
        check_plan(c, plan, budget);
        CHECK_FALSE(plan.least_memory_fallback);
        CHECK(plan.total_cost == best.total_cost);
        CHECK(rotor_lower_bound(c, budget, budget / unit) == best.total_cost);
        CHECK(any.total_cost <= best.total_cost);
        if (any.total_cost < best.total_cost) ++non_persistent_better;
        CHECK(plan.total_cost <= previous);  // more budget never costs more
        previous = plan.total_cost;
      }
    }
  }
  MESSAGE(plans << " plans equal to the exhaustive optimum, " << infeasible << " infeasible budgets; "
                << non_persistent_better << " budgets where a non-persistent schedule is cheaper");
  CHECK(plans > 1000);
}

TEST_CASE("a non-persistent schedule can beat rotor: it drops a kept checkpoint") {
  chain c;
  c.input_bytes = 3;
  c.stages = {stage(1, 7, 6, 14, 1, 1), stage(9, 12, 7, 7), stage(2, 17, 6, 9, 1, 2),
              stage(10, 18, 4, 11, 0, 3)};
  const rotor_plan persistent = plan_rotor(c, 39, 39);
  const rotor_plan any = plan_brute_force(c, 39, schedule_class::any);
  check_plan(c, persistent, 39);
  CHECK(persistent.total_cost == 98);
  CHECK(plan_brute_force(c, 39).total_cost == 98);
  REQUIRE(any.feasible);
  CHECK(any.total_cost == 97);
  // Fck1 keeps x1 to rebuild x2 after the loss; Fn1 then drops it, and Fall0 brings it back in xbar1.
  CHECK(describe_schedule(any.ops) == "Fck0 Fck1 Fn2 Fall3 Loss B3 Fn1 Fall2 B2 Fall0 Fall1 B1 B0");
  CHECK_FALSE(simulate_schedule(c, any.ops).persistent);
}

TEST_CASE("500 slots and ragged sizes: feasible exactly from the minimum, optimum bracketed by the bounds") {
  std::mt19937_64 rng(77);
  int fallbacks = 0, optimal = 0, total = 0;
  for (int n = 0; n < 150; ++n) {
    const int length = 1 + n % 5;
    const chain c = ragged_chain(rng, length);
    const std::size_t min_budget = rotor_min_budget(c);
    const std::size_t top = store_all_peak(c);
    INFO("chain " << n << " min " << min_budget << " store-all " << top);
    for (std::size_t budget :
         {min_budget - 1, min_budget, min_budget + 1, min_budget + (top - min_budget) / 7,
          min_budget + (top - min_budget) / 3, min_budget + (top - min_budget) / 2, top - 1, top}) {
      INFO("budget " << budget);
      const rotor_plan plan = plan_rotor(c, budget);
      const rotor_plan best = plan_brute_force(c, budget);
      REQUIRE(plan.feasible == best.feasible);
      CHECK(plan.feasible == (budget >= min_budget));
      if (!plan.feasible) continue;
      ++total;
      check_plan(c, plan, budget);
      CHECK(plan.total_cost >= best.total_cost);
      CHECK(rotor_lower_bound(c, budget) <= best.total_cost);
      if (plan.total_cost == best.total_cost) ++optimal;
      if (plan.least_memory_fallback) ++fallbacks;
    }
  }
  MESSAGE(total << " plans: " << optimal << " optimal despite rounding, " << fallbacks
                << " least-memory fallbacks (budget too close to the minimum for the slot grid)");
}

TEST_CASE("an unlimited budget stores everything") {
  std::mt19937_64 rng(5);
  for (int length = 1; length <= 12; ++length) {
    const chain c = ragged_chain(rng, length);
    for (std::size_t budget : {store_all_peak(c), 10 * store_all_peak(c)}) {
      const rotor_plan plan = plan_rotor(c, budget);
      check_plan(c, plan, budget);
      CHECK(plan.ops == store_all(c));
      CHECK(plan.extra_cost == 0);
    }
    // One byte less and something must be recomputed.
    const rotor_plan tight = plan_rotor(c, store_all_peak(c) - 1);
    if (tight.feasible) CHECK(tight.extra_cost > 0);
  }
}

TEST_CASE("more budget never costs more when the slot grid is exact") {
  std::mt19937_64 rng(99);
  for (int n = 0; n < 20; ++n) {
    const chain c = random_chain(rng, 8 + n % 5, 1, true);
    double previous = inf;
    for (std::size_t budget = rotor_min_budget(c); budget <= store_all_peak(c); ++budget) {
      const rotor_plan plan = plan_rotor(c, budget, budget);  // slot = 1 byte
      REQUIRE(plan.feasible);
      check_plan(c, plan, budget);
      CHECK(plan.total_cost <= previous);
      previous = plan.total_cost;
    }
    CHECK(previous == doctest::Approx(plan_rotor(c, store_all_peak(c)).total_cost));
  }
}

TEST_CASE("bad input is refused with the value and what was expected") {
  chain good;
  good.input_bytes = 16;
  good.stages = {stage(1, 2, 8, 8)};
  auto refuses = [](auto&& call, const std::string& expected) {
    try {
      call();
      FAIL("no exception; expected one mentioning: " << expected);
    } catch (const spillway::invalid_argument& e) {
      CHECK_MESSAGE(std::string(e.what()).find(expected) != std::string::npos, e.what());
    }
  };
  refuses([&] { plan_rotor(chain{}, 100); }, "no stages");
  refuses([&] { rotor_min_budget(chain{}); }, "no stages");
  refuses([&] { simulate_schedule(chain{}, {}); }, "no stages");
  refuses([&] { plan_rotor(good, 0); }, "budget_bytes is 0");
  refuses([&] { plan_rotor(good, 100, 0); }, "memory_slots is 0");
  refuses([&] { plan_brute_force(good, 0); }, "budget_bytes is 0");
  refuses([&] { rotor_lower_bound(good, 100, 0); }, "memory_slots is 0");
  refuses([&] { plan_rotor(good, std::size_t{1} << 40, std::size_t{1} << 40); },
          "memory_slots is 1099511627776");

  chain c = good;
  c.stages[0].forward_cost = -1;
  refuses([&] { plan_rotor(c, 100); }, "stage 0 forward_cost is -1");
  c.stages[0].forward_cost = std::nan("");
  refuses([&] { plan_rotor(c, 100); }, "forward_cost is NaN; expected a finite value >= 0");
  c = good;
  c.stages[0].backward_cost = inf;
  refuses([&] { rotor_min_budget(c); }, "backward_cost is +inf");
  c = good;
  c.stages[0].xbar_bytes = 4;
  refuses([&] { plan_rotor(c, 100); }, "expected xbar_bytes >= x_bytes");
  c = good;
  c.stages[0].x_bytes = c.stages[0].xbar_bytes = std::numeric_limits<std::size_t>::max() / 2;
  refuses([&] { plan_rotor(c, 100); }, "add up to more than");
  c = good;
  c.stages.assign(9, good.stages[0]);
  refuses([&] { plan_brute_force(c, 1000); }, "expected at most 8");
  // Too long for the tables: refused before any is allocated (16,384 x 16,384 / 2 rows would be
  // gigabytes even with one slot).
  c.stages.assign(16400, good.stages[0]);
  refuses([&] { plan_rotor(c, 1 << 20, 1); }, "the chain has 16400 stages; expected few enough");
  refuses([&] { rotor_lower_bound(c, 1 << 20, 1); }, "the chain has 16400 stages");
  refuses([&] { rotor_min_budget(c); }, "the chain has 16400 stages");
}

// The planning time is printed, not checked (no timing in tests): spillway-evict-sim reports it
// (rotor points' plan_seconds).
TEST_CASE("chains of 50 and 100 stages plan with 500 slots") {
  std::mt19937_64 rng(3);
  for (int length : {50, 100}) {
    const chain c = ragged_chain(rng, length);
    const std::size_t lo = rotor_min_budget(c), hi = store_all_peak(c);
    for (double f : {0.05, 0.3, 0.6}) {
      const std::size_t budget = lo + static_cast<std::size_t>(f * static_cast<double>(hi - lo));
      const auto start = std::chrono::steady_clock::now();
      const rotor_plan plan = plan_rotor(c, budget);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      check_plan(c, plan, budget);
      CHECK(plan.extra_cost > 0);
      MESSAGE("L=" << length << " budget " << budget << " (min " << lo << ", store-all " << hi
                   << "): extra cost " << plan.extra_cost << " of " << plan.total_cost - plan.extra_cost
                   << ", " << plan.ops.size() << " ops, " << seconds << " s");
      CHECK(plan.total_cost >= rotor_lower_bound(c, budget));
    }
  }
}
