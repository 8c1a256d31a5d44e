// test_engine_lineage_graph: the lineage graph's shape and lifetime — cycles, depth, and what
// forget, remove_node and set_lineage do to nodes and their inputs.
//
// It proves: a lineage cycle made with set_lineage, or a path deeper than max_recompute_depth,
// fails pin with a logic_error that says so and leaves every buffer's state and bytes as they
// were, while a long dropped chain within the default depth rematerialises without exhausting the
// stack; a forgotten input that a live node still needs is kept, hidden, so its consumers still
// recompute, and is freed (the allocator back to zero) when the last output that needs it is
// forgotten, also at the end of a chain of 100,000 forgotten in order (a loop, not a recursion: no
// stack overflow); forgetting dropped buffers keeps DTR's equivalence classes sound for later
// evictions; set_lineage moves a buffer to a new producer and the old node retires; remove_node
// releases a node that has no output at once (freeing the forgotten inputs only it held) and one
// with outputs with its last; the staleness clock advances by the cost of each node a recompute
// runs, so buffers made early in one recompute are staler than later ones. Recomputing dropped
// buffers: test_engine_lineage.cpp.
#include <doctest/doctest.h>

#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

TEST_CASE("a lineage cycle fails pin with a logic_error and changes nothing") {
  // y = n0(t, x), z = n1(y), then set_lineage makes x = back(y): a cycle through x and y. t is a
  // spilled source listed first, so a rematerialisation that restored inputs before finding the
  // cycle would show in t's state.
  engine_env env;
  lineage_graph g(env);
  const buffer_id t = g.source(8 * KiB);
  const buffer_id x = g.source(8 * KiB);
  const buffer_id y = g.node({t, x}, {8 * KiB})[0];
  const buffer_id z = g.node({y}, {8 * KiB})[0];
  env.sim->run_until_idle();
  lineage_node back;
  back.name = "back";
  back.inputs = {y};
  back.compute = g.kernel("back", 1, {y}, {8 * KiB}, std::make_shared<std::atomic<std::uint64_t>>());
  env.eng().set_lineage(x, env.eng().add_node(back));

  REQUIRE(env.eng().evict(t, eviction_mode::spill));
  env.sim->run_until_idle();
  drop(env.eng(), x);
  drop(env.eng(), y);
  const std::vector<buffer_state> states = {env.eng().state(t), env.eng().state(x),
                                            env.eng().state(y), env.eng().state(z)};
  const auto stats = env.eng().stats();
  const auto alloc_stats = env.alloc->stats();

  for (buffer_id target : {y, x}) {
    try {
      (void)env.eng().pin(target);
      FAIL("pin of a buffer on a lineage cycle returned");
    } catch (const std::logic_error& e) {
      const std::string what = e.what();
      CHECK_MESSAGE(contains(what, "cycle"), what);
      CHECK_MESSAGE(contains(what, "'back'"), what);  // the nodes on the cycle are named
      CHECK_MESSAGE(contains(what, "'n0'"), what);
    }
  }
  CHECK(env.eng().state(t) == states[0]);
  CHECK(env.eng().state(x) == states[1]);
  CHECK(env.eng().state(y) == states[2]);
  CHECK(env.eng().state(z) == states[3]);
  CHECK(env.eng().stats().recomputes == stats.recomputes);
  CHECK(env.eng().stats().restores == stats.restores);
  CHECK(env.eng().stats().pinned_bytes == 0);
  check_same_stats(alloc_stats, env.alloc->stats());
  // z and t are still intact and usable; breaking the cycle makes x and y recomputable again.
  g.expect(z);
  g.expect(t);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("a lineage deeper than max_recompute_depth fails pin and changes nothing") {
  engine_options o;
  o.engine.max_recompute_depth = 4;
  engine_env env(o);
  lineage_graph g(env);
  const std::vector<buffer_id> ids = g.chain(8, 4 * KiB);
  env.sim->run_until_idle();
  for (std::size_t i = 1; i < ids.size(); ++i) drop(env.eng(), ids[i]);
  const auto alloc_stats = env.alloc->stats();
  try {
    (void)env.eng().pin(ids.back());
    FAIL("pin returned");
  } catch (const std::logic_error& e) {
    CHECK_MESSAGE(contains(e.what(), "max_recompute_depth"), e.what());
    CHECK_MESSAGE(contains(e.what(), "4"), e.what());
  }
  for (std::size_t i = 1; i < ids.size(); ++i) CHECK(env.eng().state(ids[i]) == buffer_state::dropped);
  CHECK(env.eng().stats().recomputes == 0);
  CHECK(env.eng().stats().pinned_bytes == 0);
  check_same_stats(alloc_stats, env.alloc->stats());
  // Within the limit it works: rematerialise from the middle, then the rest is shallow enough.
  g.expect(ids[4]);
  g.expect(ids.back());
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("a long dropped chain within the default depth rematerialises without exhausting the stack") {
  engine_env env;
  lineage_graph g(env, 10);
  const std::vector<buffer_id> ids = g.chain(9000, 512);
  env.sim->run_until_idle();
  for (std::size_t i = 1; i < ids.size(); ++i) drop(env.eng(), ids[i]);
  g.expect(ids.back());
  env.sim->run_until_idle();
  CHECK(env.eng().stats().recomputes == 9000);
  env.check_clean();
}

TEST_CASE("a forgotten input that a live node needs stays, hidden, until its last consumer goes") {
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const buffer_id a = g.node({s}, {8 * KiB})[0];
  const buffer_id b = g.node({a}, {8 * KiB})[0];
  const buffer_id c = g.node({b}, {8 * KiB})[0];
  env.sim->run_until_idle();
  REQUIRE(env.eng().evict(s, eviction_mode::spill));  // a hidden input may be evicted, too
  drop(env.eng(), a);
  drop(env.eng(), b);

  env.eng().forget(s);
  env.eng().forget(a);
  env.eng().forget(b);
  CHECK(env.eng().stats().registered == 1);
  for (buffer_id id : {s, a, b}) {
    CHECK_THROWS_WITH_AS(env.eng().state(id), doctest::Contains("forgotten"), invalid_argument);
  }
  drop(env.eng(), c);
  g.expect(c);  // c -> b -> a -> s: all hidden, all brought back
  env.sim->run_until_idle();
  CHECK(env.eng().stats().recomputes == 3);
  env.check_clean();
  CHECK(env.allocated_bytes() > 8 * KiB);  // the hidden ones are resident again

  env.eng().forget(c);  // the last output: c's node retires, then b, a and s are freed in a cascade
  env.sim->run_until_idle();
  CHECK(env.eng().stats().registered == 0);
  CHECK(env.eng().stats().resident_bytes == 0);
  CHECK(env.allocated_bytes() == 0);
  CHECK(env.alloc->stats().allocation[0].current == 0);
}

TEST_CASE("a long chain forgotten in order is freed by its last forget without exhausting the stack") {
  // Each forgotten buffer stays, hidden, for the next node; forgetting the last output retires its
  // node, which frees the one before, whose node retires in turn, and so on down the chain.
  constexpr int n = 100000;
  engine_options o;
  o.capacity = 1024 * MiB;
  engine_env env(o);
  const auto noop = [](std::span<void* const>, std::span<void* const>, stream_ref) {};
  std::vector<buffer_id> xs;
  xs.reserve(n);
  xs.push_back(env.eng().register_buffer(env.alloc->allocate(512), 512, {}));
  for (int i = 1; i < n; ++i) {
    const node_id node = env.eng().add_node({.name = "x", .inputs = {xs.back()}, .compute = noop, .cost_ns = 1});
    xs.push_back(env.eng().register_buffer(env.alloc->allocate(512), 512, {}, {.producer = node}));
  }
  for (int i = 0; i + 1 < n; ++i) env.eng().forget(xs[static_cast<std::size_t>(i)]);
  CHECK(env.eng().stats().registered == 1);
  CHECK(env.alloc->stats().allocation[0].current == n);
  env.eng().forget(xs.back());
  CHECK(env.eng().stats().registered == 0);
  CHECK(env.eng().stats().resident_bytes == 0);
  CHECK(env.allocated_bytes() == 0);
  CHECK(env.alloc->stats().allocation[0].current == 0);
}

TEST_CASE("the staleness clock moves with the recomputes the engine runs, though their work is only queued") {
  // A recompute queues kernels: the device clock does not move until they run. The engine's clock
  // for staleness does, by each node's cost, so that a buffer made early in a long recompute is
  // staler than one made at its end, and both are fresher than one untouched since before it.
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const buffer_id untouched = g.node({s}, {8 * KiB}, {}, 1000)[0];
  const buffer_id a = g.node({s}, {8 * KiB}, {}, 1000)[0];
  const buffer_id b = g.node({a}, {8 * KiB}, {}, 2000)[0];
  const buffer_id c = g.node({b}, {8 * KiB}, {}, 4000)[0];
  env.sim->run_until_idle();
  env.sim->advance(1'000'000);
  drop(env.eng(), a);
  drop(env.eng(), b);
  drop(env.eng(), c);
  const std::uint64_t before = env.sim->now_ns();
  {
    pinned_buffer pin = env.eng().pin(c);  // recomputes a, b, c; nothing has run yet
    CHECK(env.sim->now_ns() == before);
  }
  const auto staleness = [&](buffer_id id) {
    const std::optional<eviction::candidate_info> info = env.eng().describe_candidate(id);
    REQUIRE(info.has_value());
    return info->staleness_ns;
  };
  // a was last used when b ran (after a's 1000 ns), b and c when c ran (after 1000 + 2000 + 4000).
  CHECK(staleness(a) == doctest::Approx(4000));
  CHECK(staleness(b) <= 1.0);
  CHECK(staleness(c) <= 1.0);
  CHECK(staleness(untouched) > 1'000'000);
  env.sim->run_until_idle();
  env.sim->advance(1'000'000);  // the device's clock passes the engine's: it leads again
  CHECK(staleness(a) >= 1'000'000);
  CHECK(staleness(b) < staleness(a));
  env.check_clean();
}

TEST_CASE("remove_node: a node with no output lets go of its inputs at once; one with outputs retires with its last") {
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const buffer_id a = g.node({s}, {8 * KiB})[0];
  env.sim->run_until_idle();
  const auto noop = [](std::span<void* const>, std::span<void* const>, stream_ref) {};
  // A node whose output is never registered (its op's result was not kept) holds s as an input.
  const node_id skipped = env.eng().add_node({.name = "skipped", .inputs = {s}, .output_count = 1,
                                              .compute = noop});
  env.eng().forget(s);  // a's producer still needs s, so it stays, hidden
  env.eng().forget(a);  // a's node retires; only `skipped` holds s now
  CHECK(env.eng().stats().registered == 0);
  CHECK(env.allocated_bytes() == 8 * KiB);
  env.eng().remove_node(skipped);  // released at once: s is freed
  CHECK(env.allocated_bytes() == 0);
  CHECK_THROWS_WITH_AS(env.eng().remove_node(skipped), doctest::Contains("no longer exists"),
                       invalid_argument);

  // A node with a registered output: removed, it may no longer be named, but its output keeps its
  // lineage (it can still be dropped and recomputed) until it is forgotten.
  const buffer_id t = g.source(8 * KiB);
  const buffer_id kept = g.node({t}, {8 * KiB})[0];
  const node_id kept_node = g.nodes().back().id;
  env.sim->run_until_idle();
  env.eng().remove_node(kept_node);
  CHECK_THROWS_WITH_AS(env.eng().remove_node(kept_node), doctest::Contains("was removed"),
                       invalid_argument);
  void* p = env.alloc->allocate(8 * KiB);
  CHECK_THROWS_WITH_AS((void)env.eng().register_buffer(p, 8 * KiB, {}, {.producer = kept_node}),
                       doctest::Contains("was removed"), invalid_argument);
  env.alloc->deallocate(p);
  drop(env.eng(), kept);
  g.expect(kept);  // recomputed from t through the removed node
  env.sim->run_until_idle();
  env.check_clean();
  env.eng().forget(t);
  env.eng().forget(kept);  // the node retires with it, and t (hidden) goes with the node
  env.sim->run_until_idle();
  CHECK(env.allocated_bytes() == 0);
  CHECK(env.eng().stats().registered == 0);
}

TEST_CASE("forgetting dropped buffers keeps DTR's equivalence classes sound") {
  // r -> a -> b -> c, with a, b, c dropped: one class. Forgetting its members one by one, then
  // evicting r (whose neighbourhood cost looks at a's class) must neither crash nor mix classes
  // with buffers registered later in the recycled slots.
  for (const std::string& policy : {std::string("dtr"), std::string("dtr-frag")}) {
    CAPTURE(policy);
    engine_options o;
    o.engine.policy = policy;
    engine_env env(o);
    lineage_graph g(env);
    const buffer_id s = g.source(4 * KiB);
    const buffer_id r = g.node({s}, {4 * KiB})[0];
    const buffer_id a = g.node({r}, {4 * KiB})[0];
    const buffer_id b = g.node({a}, {4 * KiB})[0];
    const buffer_id c = g.node({b}, {4 * KiB})[0];
    env.sim->run_until_idle();
    drop(env.eng(), a);
    drop(env.eng(), b);
    drop(env.eng(), c);
    env.eng().forget(c);
    env.eng().forget(b);
    // New buffers take the recycled slots and are dropped into classes of their own.
    const buffer_id d = g.node({r}, {4 * KiB})[0];
    const buffer_id e = g.node({d}, {4 * KiB})[0];
    env.sim->run_until_idle();
    drop(env.eng(), e);
    drop(env.eng(), r);  // joins a's class: looks at its root
    g.expect(a);
    g.expect(e);
    env.sim->run_until_idle();
    CHECK(env.eng().evict(d, eviction_mode::drop));
    CHECK(env.eng().evict(a, eviction_mode::drop));
    g.expect(e);
    g.expect(a);
    env.sim->run_until_idle();
    env.check_clean();
  }
}

TEST_CASE("set_lineage moves a buffer to a new producer; the old node retires") {
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(8 * KiB);
  const buffer_id a = g.node({s}, {8 * KiB})[0];
  env.sim->run_until_idle();
  env.eng().forget(s);  // hidden: a's node needs it

  // An in-place update a := upd(u), recorded as a's new lineage.
  const buffer_id u = g.source(8 * KiB, {}, {}, 77);
  env.sim->run_until_idle();
  auto runs = std::make_shared<std::atomic<std::uint64_t>>(0);
  lineage_node upd;
  upd.name = "upd";
  upd.inputs = {u};
  upd.compute = g.kernel("upd", 4242, {u}, {8 * KiB}, runs);
  env.eng().set_lineage(a, env.eng().add_node(upd));
  // s was needed only by a's old node, which has no output left: it retired and s was freed.
  CHECK(env.allocated_bytes() == 2 * 8 * KiB);  // a and u
  CHECK(env.eng().stats().registered == 2);

  std::vector<std::uint64_t> golden(KiB);
  const std::uint64_t* in[] = {g.at(u).golden->data()};
  std::uint64_t* out[] = {golden.data()};
  const std::size_t words[] = {KiB};
  compute_words(4242, in, words, out, words);
  drop(env.eng(), a);
  pinned_buffer p = env.eng().pin(a);
  env.sim->synchronize_stream({});
  CHECK(runs->load() == 1);
  CHECK(checksum(p.get(), 8 * KiB) == checksum(golden.data(), 8 * KiB));
  p.reset();
  env.check_clean();
}
