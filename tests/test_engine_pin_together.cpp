// test_engine_pin_together: pin_all, and a recompute's own inputs, pin several buffers together.
//
// It proves: the resident ones are pinned first, so that bringing back a dropped or spilled one
// never evicts them (a policy that would pick one of them takes another victim); a pin_all whose
// dropped input would not fit otherwise lets its own first pins go and takes that input first,
// the others evicted and brought back after it, every byte intact; when even that fails (the
// caller holds a pin itself), out_of_memory leaves no pin of the call and the buffer as it was;
// while the pins are let go, the entries count as needed now, and one rebuilt from the others
// costs its own node only; an id may repeat. Note [Pinning together lets go to fit] in docs/eviction.md.
#include <doctest/doctest.h>

#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// A full 2 MiB segment: s, x = f(s) (dropped, its block taken by `hole`), b, a raw tail; all
// 512 KiB. Recomputing x needs 512 KiB that only b could give (s is x's input).
struct full_segment {
  engine_env env{options()};
  lineage_graph g{env};
  buffer_id s = g.source(512 * KiB);
  buffer_id x = g.node({s}, {512 * KiB})[0];
  buffer_id b = g.source(512 * KiB);
  void* tail = env.alloc->allocate(512 * KiB);
  void* hole = nullptr;

  full_segment() {
    env.sim->run_until_idle();
    drop(env.eng(), x);
    hole = env.alloc->allocate(512 * KiB);
  }
  static engine_options options() {
    engine_options o;
    o.budget = 2 * MiB;
    return o;
  }
  // Frees the raw blocks, checks every buffer's bytes and the kernels' checks.
  void finish() {
    if (hole != nullptr) env.alloc->deallocate(hole);
    env.alloc->deallocate(tail);
    for (buffer_id id : {s, x, b}) g.expect(id);
    env.sim->run_until_idle();
    env.check_clean();
  }
};

}  // namespace

TEST_CASE("pin_all pins the resident inputs first: bringing back a dropped one never evicts them") {
  // A full 2 MiB segment: s, b (768 KiB), c (512 KiB), raw memory in x's hole. x = f(s) is
  // dropped. Recomputing x needs 256 KiB; "largest" would pick b, the op's other input, were it
  // not pinned already: c goes instead, and b never moves.
  engine_options o;
  o.budget = 2 * MiB;
  o.engine.policy = "largest";
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id s = g.source(256 * KiB);
  const buffer_id x = g.node({s}, {256 * KiB})[0];
  const buffer_id b = g.source(768 * KiB);
  const buffer_id c = g.source(512 * KiB);
  void* tail = env.alloc->allocate(256 * KiB);
  env.sim->run_until_idle();
  void* b_ptr = env.eng().pin(b).get();
  drop(env.eng(), x);
  void* hole = env.alloc->allocate(256 * KiB);  // x's block: the segment is full again
  {
    const std::vector<buffer_id> inputs{x, b};
    std::vector<pinned_buffer> pins = env.eng().pin_all(inputs);
    REQUIRE(pins.size() == 2);
    CHECK(pins[0].id() == x);
    CHECK(pins[1].get() == b_ptr);
    CHECK(env.eng().state(b) == buffer_state::resident);
    CHECK(env.eng().state(c) != buffer_state::resident);
    CHECK(env.eng().stats().spills == 1);
    CHECK(env.eng().stats().restores == 0);
    g.check_kernel(x, pins[0].get(), {});
    g.check_kernel(b, pins[1].get(), {});
  }
  env.alloc->deallocate(hole);
  env.alloc->deallocate(tail);
  for (buffer_id id : {s, x, b, c}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("pin_all that fails leaves no pin; an id may repeat") {
  full_segment t;
  eviction_engine& eng = t.env.eng();
  // b is pinned by the caller: nothing can be evicted for x, also when pin_all lets its own pin
  // of b go and tries x first.
  {
    pinned_buffer held = eng.pin(t.b);
    const std::vector<buffer_id> inputs{t.b, t.x};
    CHECK_THROWS_AS((void)eng.pin_all(inputs), out_of_memory);
    CHECK(eng.state(t.x) == buffer_state::dropped);
    CHECK(eng.stats().pinned_bytes == 512 * KiB);  // the caller's pin only
    CHECK(eng.stats().pin_holds_released == 1);
  }
  CHECK(eng.stats().pinned_bytes == 0);
  CHECK_NOTHROW((void)eng.evict(t.b, eviction_mode::spill));  // evict throws if pinned
  t.env.alloc->deallocate(t.hole);
  t.hole = nullptr;
  {
    const std::vector<buffer_id> twice{t.x, t.x};
    std::vector<pinned_buffer> pins = eng.pin_all(twice);
    REQUIRE(pins.size() == 2);
    CHECK(pins[0].get() == pins[1].get());
    CHECK(eng.stats().pinned_bytes == 512 * KiB);
    pins[0].reset();
    CHECK_THROWS_AS(eng.forget(t.x), invalid_argument);  // still pinned once
  }
  CHECK(eng.stats().pinned_bytes == 0);
  t.finish();
}

TEST_CASE("pin_all lets its first pins go when a dropped input would not fit otherwise") {
  // pin_all({b, x}) pins b first; recomputing x then needs b's 512 KiB. So the pin of b is let go
  // and x is taken first: b is spilled for x, then restored (s, no longer pinned, is spilled for
  // it). Note [Pinning together lets go to fit].
  full_segment t;
  eviction_engine& eng = t.env.eng();
  {
    const std::vector<buffer_id> inputs{t.b, t.x};
    std::vector<pinned_buffer> pins = eng.pin_all(inputs);
    REQUIRE(pins.size() == 2);
    CHECK(pins[0].id() == t.b);
    CHECK(pins[1].id() == t.x);
    CHECK(eng.stats().pin_holds_released == 1);
    CHECK(eng.stats().recomputes == 1);
    CHECK(eng.stats().restores == 1);  // b, after x
    CHECK(eng.state(t.s) != buffer_state::resident);
    CHECK(eng.stats().pinned_bytes == MiB);
    t.env.sim->run_until_idle();
    t.g.check_kernel(t.b, pins[0].get(), {});
    t.g.check_kernel(t.x, pins[1].get(), {});
  }
  CHECK(eng.stats().pinned_bytes == 0);
  t.finish();
}

TEST_CASE("pin_all that lets its pins go counts the inputs it takes again as needed now") {
  // A backward op on a chain: it reads a (dropped), x = fx(a) and gr = fg(s); a = fa(s). x, a
  // and gr may only be dropped, s only spilled. The segment is full (a's block is taken), so a
  // does not fit while pin_all holds x and gr, and the pins are let go. Recomputing x alone is
  // then cheap (100 ns: a is being taken anyway), though DTR's neighbourhood charges it a's class
  // (fa, 500 us); gr costs 50 us. x goes and is made again from a; s is spilled for it, because
  // gr, needed now, ranks after any candidate whose next use is later. Charging x the class
  // instead drops gr, and gr then does not fit again beside a and x: out_of_memory.
  // Note [Pinning together lets go to fit].
  engine_options o;
  o.budget = 2 * MiB;
  engine_env env(o);
  lineage_graph g(env);
  buffer_options drop_only;
  drop_only.mode = eviction_mode::drop;
  const buffer_id s = g.source(256 * KiB);
  const buffer_id gr = g.node({s}, {256 * KiB}, {}, 50'000, {drop_only})[0];
  const node_id fg = g.nodes().back().id;
  const buffer_id a = g.node({s}, {256 * KiB}, {}, 500'000, {drop_only})[0];
  const node_id fa = g.nodes().back().id;
  const buffer_id x = g.node({a}, {256 * KiB}, {}, 100, {drop_only})[0];
  const node_id fx = g.nodes().back().id;
  void* tail1 = env.alloc->allocate(512 * KiB);
  void* tail2 = env.alloc->allocate(512 * KiB);
  env.sim->run_until_idle();
  drop(env.eng(), a);
  void* hole = env.alloc->allocate(256 * KiB);  // a's block: the segment is full again
  {
    const std::vector<buffer_id> inputs{a, x, gr};
    std::vector<pinned_buffer> pins = env.eng().pin_all(inputs);
    REQUIRE(pins.size() == 3);
    CHECK(env.eng().stats().pin_holds_released == 1);
    CHECK(g.runs(fa) == 2);
    CHECK(g.runs(fx) == 2);  // dropped for a, made again from it
    CHECK(g.runs(fg) == 1);  // never evicted
    CHECK(env.eng().state(s) != buffer_state::resident);
    env.sim->run_until_idle();
    for (std::size_t i = 0; i < inputs.size(); ++i) g.check_kernel(inputs[i], pins[i].get(), {});
  }
  env.alloc->deallocate(hole);
  env.alloc->deallocate(tail1);
  env.alloc->deallocate(tail2);
  for (buffer_id id : {s, gr, a, x}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("a recompute pins its resident inputs before restoring the others") {
  // z = f(a, b) is dropped, a is spilled, b resident (768 KiB); the segment is full. Recomputing z
  // restores a (256 KiB): "largest" would evict b, the node's other input, were it not pinned
  // first; c is spilled instead and b stays where it is.
  engine_options o;
  o.budget = 2 * MiB;
  o.engine.policy = "largest";
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id a = g.source(256 * KiB);
  const buffer_id b = g.source(768 * KiB);
  const buffer_id z = g.node({a, b}, {256 * KiB})[0];
  const buffer_id c = g.source(512 * KiB);
  void* tail = env.alloc->allocate(256 * KiB);
  env.sim->run_until_idle();
  void* b_ptr = env.eng().pin(b).get();
  REQUIRE(env.eng().evict(a, eviction_mode::spill));
  drop(env.eng(), z);
  env.sim->run_until_idle();
  void* hole1 = env.alloc->allocate(256 * KiB);  // a's and z's blocks: full again
  void* hole2 = env.alloc->allocate(256 * KiB);
  g.expect(z);
  CHECK(env.eng().state(b) == buffer_state::resident);
  CHECK(env.eng().pin(b).get() == b_ptr);
  CHECK(env.eng().stats().spills == 2);    // a (by the test) and c
  CHECK(env.eng().stats().restores == 1);  // a
  env.alloc->deallocate(hole1);
  env.alloc->deallocate(hole2);
  env.alloc->deallocate(tail);
  for (buffer_id id : {a, b, c, z}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}
