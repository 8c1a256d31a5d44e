// test_engine_lineage: dropping buffers and rematerialising them from their lineage.
//
// It proves: a dropped chain and a dropped diamond come back bit-identical when their last buffer
// is pinned, each dropped node running once, its inputs rematerialised first and intact while it
// runs (the node's own kernel checks them), also under a budget that forces evictions during the
// recompute; the inputs of a recompute stay pinned (with nothing else to evict, pin fails); a
// recompute plan lets the outputs it holds for later nodes go when a node would not fit
// otherwise; a multi-output node recomputes all its outputs in one run, a resident sibling keeping
// its pointer and bytes, a spilled sibling becoming resident, and a sibling being restored not
// evicted meanwhile; a candidate is described by the stream of its block's pool; a recomputed
// output that lives on another stream than its node is ordered after the node's stream (by an
// event, else by draining the node's stream), and stays dropped with a device_error that says why
// when neither can be done; a compute that throws fails pin with its exception, the buffers as
// they were. The graph's shape and lifetime (cycles, depth, forget, remove_node, set_lineage):
// test_engine_lineage_graph.cpp. Pinning several buffers together: test_engine_pin_together.cpp.
#include <doctest/doctest.h>

#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine_fixture.hpp"
#include "forwarding_backend.hpp"

using namespace spillway;
using namespace spillway::test;

TEST_CASE("a dropped chain comes back from its end: each node once, inputs first") {
  engine_env env;
  lineage_graph g(env);
  const std::vector<buffer_id> ids = g.chain(8, 16 * KiB);
  env.sim->run_until_idle();
  for (std::size_t i = 1; i < ids.size(); ++i) drop(env.eng(), ids[i]);
  const std::size_t allocated = env.allocated_bytes();
  CHECK(allocated == 16 * KiB);  // only the source is left on the device

  {
    pinned_buffer last = g.expect_now(ids.back());
    CHECK(last.size() == 16 * KiB);
  }
  CHECK(env.eng().stats().recomputes == 8);
  for (const auto& n : g.nodes()) CHECK(n.runs->load() == 2);  // the test's run and one recompute
  for (std::size_t i = 1; i < ids.size(); ++i) {
    CHECK(env.eng().state(ids[i]) == buffer_state::resident);  // inputs were rematerialised too
  }
  for (buffer_id id : ids) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
  CHECK(env.log.checks() == ids.size());
}

TEST_CASE("a dropped diamond: the shared input is rematerialised once, before both branches") {
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const buffer_id a = g.node({s}, {8 * KiB})[0];
  const buffer_id b = g.node({a}, {8 * KiB})[0];
  const buffer_id c = g.node({a}, {4 * KiB})[0];
  const buffer_id d = g.node({b, c}, {8 * KiB})[0];
  env.sim->run_until_idle();
  for (buffer_id id : {a, b, c, d}) drop(env.eng(), id);

  g.expect(d);
  env.sim->run_until_idle();
  CHECK(env.eng().stats().recomputes == 4);
  for (const auto& n : g.nodes()) CHECK(n.runs->load() == 2);
  for (buffer_id id : {s, a, b, c, d}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("rematerialising under a tight budget evicts others, never the inputs in use") {
  // 2 MiB of budget (one small segment) for a chain of 6 x 512 KiB: a recompute of the end needs
  // evictions on the way, and each node's kernel checks that its input is still intact.
  for (const std::string& policy : eviction::policy_names()) {
    CAPTURE(policy);
    engine_options o;
    o.budget = 2 * MiB;
    o.engine.policy = policy;
    engine_env env(o);
    lineage_graph g(env);
    const std::vector<buffer_id> ids = g.chain(6, 512 * KiB);
    env.sim->run_until_idle();
    for (std::size_t i = 1; i < ids.size(); ++i) {
      if (env.eng().state(ids[i]) == buffer_state::resident) drop(env.eng(), ids[i]);
    }
    const auto before = env.eng().stats().evictions;
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      g.expect(*it);
      env.sim->run_until_idle();
    }
    CHECK(env.eng().stats().evictions > before);
    CHECK(env.log.checks() == ids.size());
    env.check_clean();
  }
}

TEST_CASE("the inputs of a recompute stay pinned: with nothing else to evict, pin fails instead") {
  // A 2 MiB budget, full: x (the input), two pinned fillers and a raw allocation. y = f(x) is
  // dropped; recomputing it needs 512 KiB, and the only unpinned buffer is x, which y reads.
  engine_options o;
  o.budget = 2 * MiB;
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id x = g.source(512 * KiB);
  const buffer_id y = g.node({x}, {512 * KiB})[0];
  const buffer_id f1 = g.source(512 * KiB);
  env.sim->run_until_idle();
  drop(env.eng(), y);
  const buffer_id f2 = g.source(512 * KiB);
  pinned_buffer hold1 = env.eng().pin(f1);
  pinned_buffer hold2 = env.eng().pin(f2);
  void* raw = env.alloc->allocate(512 * KiB);
  env.sim->run_until_idle();

  CHECK_THROWS_AS((void)env.eng().pin(y), out_of_memory);
  CHECK(env.eng().state(x) == buffer_state::resident);
  CHECK(env.eng().state(y) == buffer_state::dropped);
  CHECK(env.eng().stats().evictions == 1);  // only the drop above
  env.alloc->deallocate(raw);
  g.expect(y);
  g.expect(x);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("a recompute plan lets its held outputs go when a node would not fit otherwise") {
  // x1 = f(x0), x2 = g(x1), x3 = k(x2), x4 = h(x1, x3), all dropped, in one 2 MiB small segment.
  // Rematerialising x4 runs f, g, k, h and holds x1 from f until h reads it. At k, x0 (256 KiB,
  // no lineage, spilling off) + x1 (512) + x2 (1024, k's input) + x3 (512) exceed 2 MiB: the plan
  // lets x1 go, it is dropped for x3, and h rematerialises it again (x2, done with, makes room).
  engine_options o;
  o.engine.allow_spill = false;
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id x4 = held_outputs_graph(env, g)[4];

  g.expect(x4);
  env.sim->run_until_idle();
  CHECK(env.eng().stats().plan_holds_released == 1);
  CHECK(g.nodes()[0].runs->load() == 3);  // f: the test's run, the plan's, once more for h
  CHECK(g.nodes()[3].runs->load() == 2);  // h: the test's run and the plan's
  env.check_clean();  // every kernel found its inputs intact
}

TEST_CASE("a multi-output node: pinning one dropped output restores all in one run") {
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const std::vector<buffer_id> outs = g.node({s}, {8 * KiB, 16 * KiB, 4 * KiB});
  const node_id n = g.nodes().back().id;
  env.sim->run_until_idle();

  SUBCASE("one output dropped, the siblings resident: they keep their pointers and bytes") {
    void* p1 = env.eng().pin(outs[1]).get();
    void* p2 = env.eng().pin(outs[2]).get();
    pinned_buffer hold2 = env.eng().pin(outs[2]);  // a pinned sibling is also written to scratch
    drop(env.eng(), outs[0]);
    const auto recomputes = env.eng().stats().recomputes;
    g.expect(outs[0]);
    CHECK(env.eng().stats().recomputes == recomputes + 1);
    CHECK(g.runs(n) == 2);
    CHECK(env.eng().pin(outs[1]).get() == p1);
    CHECK(hold2.get() == p2);
    g.expect(outs[1]);
  }
  SUBCASE("two dropped, one spilled: one run brings all three back, the host copy discarded") {
    drop(env.eng(), outs[0]);
    drop(env.eng(), outs[2]);
    REQUIRE(env.eng().evict(outs[1], eviction_mode::spill));
    env.sim->run_until_idle();
    REQUIRE(env.eng().state(outs[1]) == buffer_state::spilled);
    const auto restores = env.eng().stats().restores;
    g.expect(outs[2]);
    CHECK(g.runs(n) == 2);
    for (buffer_id id : outs) CHECK(env.eng().state(id) == buffer_state::resident);
    CHECK(env.eng().stats().restores == restores);  // recomputed, not copied back
    g.expect(outs[1]);
  }
  SUBCASE("one output forgotten: the others still recompute (the forgotten one into scratch)") {
    env.eng().forget(outs[1]);
    drop(env.eng(), outs[0]);
    drop(env.eng(), outs[2]);
    g.expect(outs[0]);
    CHECK(g.runs(n) == 2);
    CHECK(env.eng().state(outs[2]) == buffer_state::resident);
    g.expect(outs[2]);
    env.sim->run_until_idle();
    CHECK(env.allocated_bytes() == (8 + 8 + 4) * KiB);  // no scratch left behind
  }
  env.sim->run_until_idle();
  for (buffer_id id : {outs[0], outs[2]}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}

namespace {

// The sim, with stream_wait_event (and, when `sync_too`, synchronize_stream) failing while armed.
struct failing_ordering final : forwarding_backend {
  using forwarding_backend::forwarding_backend;
  bool armed = false;
  bool sync_too = false;
  int failed = 0;
  void before(backend_call c) override {
    if (!armed) return;
    if (c == backend_call::stream_wait_event ||
        (sync_too && c == backend_call::synchronize_stream)) {
      ++failed;
      throw device_error("injected: the device cannot order streams");
    }
  }
};

}  // namespace

namespace {

// The sim, with the engine's event queries answered "not yet" while `hide` is set.
struct late_events final : forwarding_backend {
  using forwarding_backend::forwarding_backend;
  bool hide = false;
  bool event_completed(event_ref e) override {
    return !hide && forwarding_backend::event_completed(e);
  }
};

}  // namespace

TEST_CASE("a sibling being restored is not evicted while its node is recomputed") {
  // n = f(s) makes O and X. O is restored ahead (its copy back done, not yet seen), X dropped;
  // pinning X recomputes n: O, first, gets a scratch block, then X's block needs room. The first
  // pressure round frees a ballast block (a handler of the test's, after the engine's) and lets
  // the events be seen; in the second the engine's reap finds O resident. It must not become a
  // victim there: its turn is past (its scratch taken), and a plan would pin it while evicted.
  // With nothing else to evict, pin fails.
  std::shared_ptr<late_events> events;
  engine_options o;
  o.budget = 2 * MiB;  // one small-pool segment
  o.backend = [&events](std::shared_ptr<sim_device> sim) {
    events = std::make_shared<late_events>(std::move(sim));
    return events;
  };
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id s = g.source(512 * KiB);
  const std::vector<buffer_id> ox = g.node({s}, {768 * KiB, 512 * KiB});
  const buffer_id out = ox[0], x = ox[1];
  void* ballast = env.alloc->allocate(256 * KiB);
  env.sim->run_until_idle();
  drop(env.eng(), x);
  void* in_x_place = env.alloc->allocate(512 * KiB);  // not the engine's: never evicted
  REQUIRE(env.eng().evict(out, eviction_mode::spill));
  env.sim->run_until_idle();
  REQUIRE(env.eng().state(out) == buffer_state::spilled);
  env.eng().prefetch(out);
  env.sim->run_until_idle();  // its copy back is done; the engine has not looked
  events->hide = true;
  env.alloc->add_pressure_handler([&](const pressure_request&) {
    pressure_result r;
    if (ballast != nullptr) {
      events->hide = false;
      env.alloc->deallocate(std::exchange(ballast, nullptr));
      r.freed = 256 * KiB;
    }
    return r;
  });
  const auto evictions = env.eng().stats().evictions;
  CHECK_THROWS_AS((void)env.eng().pin(x), out_of_memory);
  CHECK(ballast == nullptr);  // the second round came
  CHECK(env.eng().stats().evictions == evictions);
  CHECK(env.eng().state(out) == buffer_state::resident);
  CHECK(env.eng().stats().pinned_bytes == 0);
  env.alloc->deallocate(in_x_place);
  env.alloc->set_budget(8 * MiB);  // room for X and O's scratch now
  g.expect(x);
  g.expect(out);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("a candidate is described by the stream of its block's pool, where evicting it frees a range") {
  // The node runs on a; its second output lives on b. Registered from b's allocation, its block
  // is in b's pool; recomputed, in a's (the node's stream), used on b: a request on a is what
  // evicting it serves then, not one on b.
  engine_options o;
  o.streams = 1;
  o.engine.allow_spill = false;
  engine_env env(o);
  lineage_graph g(env);
  const stream_ref a{}, b = env.stream(0);
  const buffer_id x = g.source(64 * KiB, a);
  const std::vector<buffer_id> ys = g.node({x}, {64 * KiB, 32 * KiB}, a, 1000, {}, {a, b});
  env.sim->run_until_idle();
  const auto described_stream = [&](buffer_id id) {
    const std::optional<eviction::candidate_info> c = env.eng().describe_candidate(id);
    REQUIRE(c.has_value());
    return c->stream;
  };
  CHECK(described_stream(ys[1]) == b);
  drop(env.eng(), ys[1]);
  g.expect(ys[1]);
  env.sim->run_until_idle();
  CHECK(env.alloc->describe(env.eng().pin(ys[1]).get()).stream == a);
  CHECK(described_stream(ys[1]) == a);
  env.check_clean();
}

TEST_CASE("a recomputed output on another stream is ordered after the node, or stays evicted") {
  std::shared_ptr<failing_ordering> faults;
  engine_options o;
  o.streams = 1;
  o.engine.bandwidth = {o.h2d_bandwidth, o.d2h_bandwidth};  // the sim's: nothing to measure
  o.backend = [&faults](std::shared_ptr<sim_device> sim) {
    faults = std::make_shared<failing_ordering>(std::move(sim));
    return faults;
  };
  engine_env env(o);
  lineage_graph g(env);
  const stream_ref a{}, b = env.stream(0);
  const buffer_id x = g.source(64 * KiB, a);
  // The node runs on a (its first output's stream); its second output lives on b.
  const std::vector<buffer_id> ys = g.node({x}, {64 * KiB, 32 * KiB}, a, 1000, {}, {a, b});
  const node_id n = g.nodes().back().id;
  env.sim->run_until_idle();
  drop(env.eng(), ys[0]);
  drop(env.eng(), ys[1]);

  SUBCASE("no event to order b after a: a is drained instead") {
    faults->armed = true;
    void* p = env.eng().pin(ys[1]).get();
    faults->armed = false;
    CHECK(faults->failed == 1);
    CHECK(p != nullptr);
    CHECK(env.eng().state(ys[1]) == buffer_state::resident);
    CHECK(g.runs(n) == 2);
  }
  SUBCASE("neither an event nor a drain: the output stays dropped and pin says why") {
    faults->armed = true;
    faults->sync_too = true;
    CHECK_THROWS_WITH_AS(env.eng().pin(ys[1]),
                         doctest::Contains("output 1 cannot be ordered for its stream"),
                         device_error);
    faults->armed = false;
    CHECK(faults->failed == 2);
    CHECK(env.eng().state(ys[1]) == buffer_state::dropped);
    CHECK(env.eng().state(ys[0]) == buffer_state::resident);  // on the node's own stream
    CHECK(g.runs(n) == 2);
    env.sim->run_until_idle();
    CHECK(env.allocated_bytes() == (64 + 64) * KiB);  // x and ys[0]: ys[1]'s block went back
  }
  for (buffer_id id : ys) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}
TEST_CASE("a compute that throws fails pin with its exception; the buffers stay as they were") {
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const buffer_id a = g.node({s}, {8 * KiB})[0];
  env.sim->run_until_idle();
  // b = flaky(a), registered as computed; its compute throws while `fail` is set.
  auto fail = std::make_shared<bool>(true);
  auto runs = std::make_shared<std::atomic<std::uint64_t>>(0);
  const eviction::compute_fn inner = g.kernel("flaky", 5, {a}, {8 * KiB, 4 * KiB}, runs);
  lineage_node flaky;
  flaky.name = "flaky";
  flaky.inputs = {a};
  flaky.output_count = 2;
  flaky.compute = [fail, inner](std::span<void* const> in, std::span<void* const> out, stream_ref st) {
    if (*fail) throw std::runtime_error("flaky: the kernel launch failed");
    inner(in, out, st);
  };
  const node_id n = env.eng().add_node(flaky);
  void* pb = env.alloc->allocate(8 * KiB);
  void* pc = env.alloc->allocate(4 * KiB);
  {
    pinned_buffer in = env.eng().pin(a);
    void* ins[] = {in.get()};
    void* outs[] = {pb, pc};
    inner(ins, outs, {});
  }
  const buffer_id b = env.eng().register_buffer(pb, 8 * KiB, {}, {.producer = n, .output_index = 0});
  const buffer_id c = env.eng().register_buffer(pc, 4 * KiB, {}, {.producer = n, .output_index = 1});
  env.sim->run_until_idle();
  const std::uint64_t sum_b = checksum(pb, 8 * KiB);
  drop(env.eng(), a);
  drop(env.eng(), b);  // c stays resident: it is written to scratch
  const std::size_t allocated = env.allocated_bytes();

  CHECK_THROWS_WITH_AS((void)env.eng().pin(b), "flaky: the kernel launch failed", std::runtime_error);
  CHECK(env.eng().state(b) == buffer_state::dropped);
  CHECK(env.eng().state(c) == buffer_state::resident);
  CHECK(env.eng().stats().pinned_bytes == 0);
  CHECK(env.allocated_bytes() == allocated + 8 * KiB);  // a was rematerialised first, and stays
  CHECK(env.eng().evict(c));  // c is a candidate again, not left out of the set

  *fail = false;
  pinned_buffer p = env.eng().pin(b);
  env.sim->synchronize_stream({});
  CHECK(checksum(p.get(), 8 * KiB) == sum_b);
  p.reset();
  env.check_clean();
}
