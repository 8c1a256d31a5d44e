// test_engine_next_use: next-use prediction (eviction_engine::begin_step, Note [Next-use
// prediction]). Once steps are marked, the engine records which of a step's buffers each pin reads
// and, in the next step, tells the policy how soon each candidate is read again.
//
// It proves, through describe_candidate and the pressure path: no prediction without steps, in
// the first step, or with predict_next_use off; in the second step, the time from the current
// access to the buffer's next recorded read, as the recorded step measured it; a buffer the
// record does not read again is placed past the step's end; a buffer whose size changed is not
// predicted; a read the record does not show counts as a mismatch and ends that buffer's
// predictions, not the others'; under pressure DTR then evicts the buffer needed last, where
// staleness alone picks the one used longest ago; and a buffer that a dropped dependant will be
// rebuilt from is needed when that dependant's class is (merges, splits and the fallback to its
// own read included), while a dropped ancestor changes nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

constexpr std::uint64_t us = 1000;
constexpr std::size_t k_bytes = 64 * KiB;

double next_use(const engine_env& env, buffer_id id) {
  const std::optional<eviction::candidate_info> c = env.eng().describe_candidate(id);
  REQUIRE_MESSAGE(c.has_value(), "buffer " << id.value << " is not a candidate");
  return c->next_use_ns;
}

void touch(engine_env& env, buffer_id id) {
  pinned_buffer p = env.eng().pin(id);
  (void)p;
}

// One step: registers a, b and `unread` (never read); reads a, then b 100 us later, then a again
// 100 us after that. Returns {a, b, unread}.
std::vector<buffer_id> run_step(engine_env& env, lineage_graph& g, std::size_t b_bytes = k_bytes) {
  env.eng().begin_step();
  const buffer_id a = g.source(k_bytes), b = g.source(b_bytes), unread = g.source(k_bytes);
  env.sim->run_until_idle();
  touch(env, a);
  env.sim->advance(100 * us);
  touch(env, b);
  env.sim->advance(100 * us);
  touch(env, a);
  return {a, b, unread};
}

void forget_all(engine_env& env, const std::vector<buffer_id>& ids) {
  for (buffer_id id : ids) env.eng().forget(id);
}

}  // namespace

TEST_CASE("no prediction without steps, in the first step, or with predict_next_use off") {
  SUBCASE("no steps") {
    engine_env env;
    lineage_graph g(env);
    const buffer_id a = g.source(k_bytes);
    env.sim->run_until_idle();
    touch(env, a);
    CHECK(std::isnan(next_use(env, a)));
    CHECK(env.eng().stats().steps == 0);
  }
  SUBCASE("the first step has nothing recorded to predict from") {
    engine_env env;
    lineage_graph g(env);
    const std::vector<buffer_id> ids = run_step(env, g);
    for (buffer_id id : ids) CHECK(std::isnan(next_use(env, id)));
    CHECK(env.eng().stats().steps == 1);
  }
  SUBCASE("predict_next_use = false: begin_step does nothing") {
    engine_options o;
    o.engine.predict_next_use = false;
    engine_env env(o);
    lineage_graph g(env);
    forget_all(env, run_step(env, g));
    env.eng().begin_step();
    const buffer_id a = g.source(k_bytes), b = g.source(k_bytes);
    env.sim->run_until_idle();
    touch(env, a);
    CHECK(std::isnan(next_use(env, b)));
    CHECK(env.eng().stats().steps == 0);
  }
}

TEST_CASE("a recorded step that registered buffers and read none: no prediction, no span to reach past") {
  engine_env env;
  lineage_graph g(env);
  env.eng().begin_step();
  const buffer_id a = g.source(k_bytes);  // registered, never pinned
  env.sim->run_until_idle();
  env.eng().begin_step();
  const buffer_id b = g.source(k_bytes);  // a's key in this step: "not read again in the step"
  env.sim->run_until_idle();
  CHECK(std::isnan(next_use(env, b)));  // before the step's first read: the record has no times
  CHECK(std::isnan(next_use(env, a)));  // of the step before: never predicted
  touch(env, b);  // a read the record does not show: predictions for b end
  CHECK(std::isnan(next_use(env, b)));
}

TEST_CASE("the second step: each buffer's next read, timed as the recorded step ran") {
  engine_env env;
  lineage_graph g(env);
  forget_all(env, run_step(env, g));

  env.eng().begin_step();
  const buffer_id a = g.source(k_bytes), b = g.source(k_bytes), unread = g.source(k_bytes);
  env.sim->run_until_idle();
  touch(env, a);  // the step's first read, as recorded
  CHECK(next_use(env, b) == doctest::Approx(100 * us));  // read one access later, 100 us on
  CHECK(next_use(env, a) == doctest::Approx(200 * us));  // read again two accesses later
  // Never read: past the step's end (200 us left of it, then a whole step, its sources' kernels
  // included), later than any read.
  CHECK(next_use(env, unread) > 400 * us);
  CHECK(next_use(env, unread) < 420 * us);
  env.sim->advance(5 * us);  // time in this step does not move the prediction; accesses do
  CHECK(next_use(env, b) == doctest::Approx(100 * us));
  touch(env, b);
  CHECK(next_use(env, a) == doctest::Approx(100 * us));
  CHECK(next_use(env, b) > 200 * us);  // b is not read again
  CHECK(env.eng().stats().next_use_mismatches == 0);
  CHECK(env.eng().stats().steps == 2);
}

TEST_CASE("a buffer whose size changed, or that was read off the record, is not predicted") {
  engine_env env;
  lineage_graph g(env);
  forget_all(env, run_step(env, g));

  SUBCASE("size") {
    env.eng().begin_step();
    const buffer_id a = g.source(k_bytes), b = g.source(2 * k_bytes);
    env.sim->run_until_idle();
    touch(env, a);
    CHECK(std::isnan(next_use(env, b)));
    CHECK(next_use(env, a) == doctest::Approx(200 * us));
  }
  SUBCASE("read off the record: a mismatch, and that buffer's predictions end") {
    env.eng().begin_step();
    const buffer_id a = g.source(k_bytes), b = g.source(k_bytes), unread = g.source(k_bytes);
    env.sim->run_until_idle();
    touch(env, b);  // the record read a first
    CHECK(env.eng().stats().next_use_mismatches == 1);
    touch(env, b);  // b again at the access where the record read b: no new mismatch, still off
    CHECK(env.eng().stats().next_use_mismatches == 1);
    CHECK(std::isnan(next_use(env, b)));
    CHECK(std::isnan(next_use(env, a)));  // its recorded read (the first access) did not come
    CHECK(next_use(env, unread) > 300 * us);  // still as recorded: never read in the step
  }
  SUBCASE("past the recorded step's last access") {
    env.eng().begin_step();
    const buffer_id a = g.source(k_bytes), b = g.source(k_bytes);
    env.sim->run_until_idle();
    for (int k = 0; k < 3; ++k) touch(env, k % 2 == 0 ? a : b);
    const buffer_id c = g.source(k_bytes);  // the fourth access has no record
    env.sim->run_until_idle();
    touch(env, c);
    CHECK(std::isnan(next_use(env, a)));
  }
}

TEST_CASE("under pressure, dtr evicts the buffer needed last, not the one used longest ago") {
  // a and b, 12 MiB each (a segment each), under a 30 MiB budget: a third 12 MiB allocation evicts
  // one of them. a was read before b, but is read again before b: staleness says a, the record b.
  engine_options o;
  o.budget = 30 * MiB;
  o.engine.policy = "dtr";
  engine_env env(o);
  lineage_graph g(env);
  const auto step = [&] {
    env.eng().begin_step();
    const buffer_id a = g.source(12 * MiB), b = g.source(12 * MiB);
    env.sim->run_until_idle();
    touch(env, a);
    env.sim->advance(100 * us);
    touch(env, b);
    env.sim->advance(100 * us);
    void* c = env.alloc->allocate(12 * MiB, {});  // evicts a or b
    const buffer_state sa = env.eng().state(a), sb = env.eng().state(b);
    touch(env, a);
    env.sim->run_until_idle();  // a spilled copy back completes before b may need its room
    env.sim->advance(100 * us);
    touch(env, b);
    env.sim->run_until_idle();
    env.sim->run_until_idle();
    g.expect(a);
    env.sim->run_until_idle();
    g.expect(b);
    env.sim->run_until_idle();
    env.alloc->deallocate(c);
    forget_all(env, {a, b});
    return std::pair{sa, sb};
  };
  const auto [first_a, first_b] = step();  // recording: staleness decides
  CHECK(first_a == buffer_state::spilled);
  CHECK(first_b == buffer_state::resident);
  const auto [second_a, second_b] = step();  // predicted: a is read again first
  CHECK(second_a == buffer_state::resident);
  CHECK(second_b == buffer_state::spilled);
  CHECK(env.eng().stats().next_use_mismatches == 0);
  env.check_clean();
}

TEST_CASE("a buffer is needed when a dropped dependant is: its class's earliest read") {
  // x1 (a source) feeds x2 and x3a; x2 feeds x3a and x3b. Recorded reads: x1 at the step's first
  // access (e0), x2 100 us later (e1), x3b at 200 us (e2), x3a at 300 us (e3); x1 never again.
  engine_env env;
  lineage_graph g(env);
  const auto step = [&](const auto& after_first_read, const auto& after_x2) {
    env.eng().begin_step();
    const buffer_id x1 = g.source(k_bytes);
    const buffer_id x2 = g.node({x1}, {k_bytes})[0];
    const buffer_id x3a = g.node({x1, x2}, {k_bytes})[0];
    const buffer_id x3b = g.node({x2}, {k_bytes})[0];
    env.sim->run_until_idle();
    touch(env, x1);
    after_first_read(x1, x2, x3a, x3b);
    env.sim->advance(100 * us);
    touch(env, x2);  // brings it back if dropped: a recompute from x1
    after_x2(x1, x2, x3a, x3b);
    env.sim->advance(100 * us);
    touch(env, x3b);
    env.sim->advance(100 * us);
    touch(env, x3a);
    env.sim->run_until_idle();
    for (buffer_id id : {x2, x3a, x3b}) g.expect(id);
    forget_all(env, {x1, x2, x3a, x3b});
  };
  const auto nothing = [](buffer_id, buffer_id, buffer_id, buffer_id) {};
  step(nothing, nothing);  // the record

  step(
      [&](buffer_id x1, buffer_id x2, buffer_id x3a, buffer_id x3b) {
        CHECK(next_use(env, x1) > 400 * us);  // not read again: past the step's end
        REQUIRE(env.eng().evict(x3a, eviction_mode::drop));
        CHECK(next_use(env, x1) == doctest::Approx(300 * us));  // x3a, recomputed from it at e3
        REQUIRE(env.eng().evict(x3b, eviction_mode::drop));     // not x1's dependant: no change
        CHECK(next_use(env, x1) == doctest::Approx(300 * us));
        CHECK(next_use(env, x2) == doctest::Approx(100 * us));  // its own read comes first
        // x2 joins both: one class, whose earliest read is x2's own at e1.
        REQUIRE(env.eng().evict(x2, eviction_mode::drop));
        CHECK(next_use(env, x1) == doctest::Approx(100 * us));
      },
      [&](buffer_id x1, buffer_id x2, buffer_id, buffer_id) {
        // x2 is back: the class falls apart into x3a's (e3) and x3b's (e2).
        CHECK(next_use(env, x1) == doctest::Approx(200 * us));  // x3a's, 200 us after e1
        CHECK(next_use(env, x2) == doctest::Approx(100 * us));  // x3b's; its own: never again
      });
  CHECK(env.eng().stats().next_use_mismatches == 0);
  env.check_clean();
}

TEST_CASE("a dropped buffer upstream does not make its dependants needed sooner") {
  // x -> y -> z, read in that order 100 us apart (e0, e1, e2). With y dropped, x is needed at e1
  // (y's recompute reads it); z is still needed at its own read, e2: y is rebuilt from x, not z.
  engine_env env;
  lineage_graph g(env);
  const auto step = [&](bool drop) {
    env.eng().begin_step();
    const buffer_id x = g.source(k_bytes);
    const buffer_id y = g.node({x}, {k_bytes})[0];
    const buffer_id z = g.node({y}, {k_bytes})[0];
    env.sim->run_until_idle();
    touch(env, x);
    if (drop) {
      REQUIRE(env.eng().evict(y, eviction_mode::drop));
      CHECK(next_use(env, x) == doctest::Approx(100 * us));
      CHECK(next_use(env, z) == doctest::Approx(200 * us));
    }
    for (buffer_id id : {y, z}) {
      env.sim->advance(100 * us);
      touch(env, id);
    }
    env.sim->run_until_idle();
    g.expect(y);
    forget_all(env, {x, y, z});
  };
  step(false);
  step(true);
  CHECK(env.eng().stats().next_use_mismatches == 0);
  env.check_clean();
}

TEST_CASE("a dependants' read that is due or did not come leaves the buffer its own") {
  // x -> y, and w; recorded reads x (e0), y (e1), w (e2). The predicted step drops y, then reads
  // w where the record read y: y's read, due at e1, does not come, and x, needed then only
  // through y, falls back on its own prediction (not read again) instead of losing it.
  engine_env env;
  lineage_graph g(env);
  const auto step = [&](bool off_record) {
    env.eng().begin_step();
    const buffer_id x = g.source(k_bytes);
    const buffer_id y = g.node({x}, {k_bytes})[0];
    const buffer_id w = g.source(k_bytes);
    env.sim->run_until_idle();
    touch(env, x);
    if (off_record) {
      REQUIRE(env.eng().evict(y, eviction_mode::drop));
      CHECK(next_use(env, x) == doctest::Approx(100 * us));  // y's read, through y's recompute
    }
    env.sim->advance(100 * us);
    touch(env, off_record ? w : y);
    if (off_record) CHECK(next_use(env, x) > 200 * us);  // past the step's end, not NaN
    env.sim->advance(100 * us);
    touch(env, off_record ? y : w);
    env.sim->run_until_idle();
    g.expect(y);
    forget_all(env, {x, y, w});
  };
  step(false);
  step(true);
  env.check_clean();
}
