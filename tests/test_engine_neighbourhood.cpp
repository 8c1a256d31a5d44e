// test_engine_neighbourhood: the neighbourhood cost a policy is told (DTR's evicted neighbourhood),
// cached on each buffer by the engine and kept up to date as buffers are dropped, brought back,
// registered, forgotten and given new lineage.
//
// It proves, through eviction_engine::describe_candidate: a buffer's neighbourhood cost is the
// summed recompute cost of the connected sets of dropped buffers next to it, each counted once;
// it rises when a neighbour is dropped and when two sets next to it merge; it falls when a
// neighbour is brought back; a set cut in two by bringing back the buffer between them charges
// each side only for its own part, while two dropped neighbours still joined another way stay
// one set; forgetting a dropped buffer that joined two sets cuts them apart; set_lineage moves a
// buffer's neighbourhood with its producer; a node's dropped outputs are one set that counts the
// node once, and a buffer whose sibling is dropped is not charged its own node again. And, on
// random graphs with random drops, restores and new nodes, every candidate's cost equals one
// computed from scratch by the test. And that a
// decision finds the one buffer that is cheap per byte among more than DTR samples, because the
// engine's order of candidates by cost per byte follows each change of its neighbourhood; and
// that this order (cheapest_to_drop) is by what dropping costs, leaves out pinned buffers and
// never holds one that can only be spilled, and that set_lineage moves a candidate in it.
#include <doctest/doctest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// Drops only, so that every candidate with lineage is described with its neighbourhood cost.
engine_options drop_only() {
  engine_options o;
  o.engine.allow_spill = false;
  return o;
}

double neighbourhood(const engine_env& env, buffer_id id) {
  const std::optional<eviction::candidate_info> c = env.eng().describe_candidate(id);
  REQUIRE_MESSAGE(c.has_value(), "buffer " << id.value << " is not a candidate");
  return c->neighbourhood_cost_ns;
}

void drop(const engine_env& env, buffer_id id) { spillway::test::drop(env.eng(), id); }

constexpr std::size_t k_bytes = 4 * KiB;

}  // namespace

TEST_CASE("a chain: dropping a neighbour charges it, merging sets charges their sum, restoring takes it off") {
  engine_env env(drop_only());
  lineage_graph g(env);
  const buffer_id s = g.source(k_bytes);
  const buffer_id a = g.node({s}, {k_bytes}, {}, 1000)[0];
  const buffer_id b = g.node({a}, {k_bytes}, {}, 2000)[0];
  const buffer_id c = g.node({b}, {k_bytes}, {}, 4000)[0];
  const buffer_id d = g.node({c}, {k_bytes}, {}, 8000)[0];
  const buffer_id e = g.node({d}, {k_bytes}, {}, 16000)[0];
  env.sim->run_until_idle();
  for (buffer_id id : {a, b, c, d, e}) CHECK(neighbourhood(env, id) == 0);

  drop(env, c);
  CHECK(neighbourhood(env, b) == 4000);
  CHECK(neighbourhood(env, d) == 4000);
  CHECK(neighbourhood(env, a) == 0);
  drop(env, d);  // {c, d}: one set
  CHECK(neighbourhood(env, b) == 12000);
  CHECK(neighbourhood(env, e) == 12000);
  drop(env, a);  // a set of its own, next to b as well: b pays both
  CHECK(neighbourhood(env, b) == 13000);
  drop(env, b);  // joins {a} and {c, d}
  CHECK(neighbourhood(env, e) == 15000);

  g.expect(b);  // recomputes a, then b: {c, d} is left
  env.sim->run_until_idle();
  CHECK(neighbourhood(env, a) == 0);
  CHECK(neighbourhood(env, b) == 12000);
  CHECK(neighbourhood(env, e) == 12000);
  g.expect(c);
  env.sim->run_until_idle();
  CHECK(neighbourhood(env, b) == 0);
  CHECK(neighbourhood(env, c) == 8000);
  CHECK(neighbourhood(env, e) == 8000);
  g.expect(e);
  g.expect(d);
  env.sim->run_until_idle();
  for (buffer_id id : {a, b, c, d, e}) CHECK(neighbourhood(env, id) == 0);
  env.check_clean();
}

TEST_CASE("bringing back the buffer between two dropped sets cuts them apart; another path keeps them one") {
  // m has two consumers, a and b; r reads a, q reads b. With m, a and b dropped they are one set.
  engine_env env(drop_only());
  lineage_graph g(env);
  const buffer_id s = g.source(k_bytes);
  const buffer_id m = g.node({s}, {k_bytes}, {}, 100)[0];
  const buffer_id a = g.node({m}, {k_bytes}, {}, 10)[0];
  const buffer_id b = g.node({m}, {k_bytes}, {}, 1000)[0];
  const buffer_id r = g.node({a}, {k_bytes}, {}, 1)[0];
  const buffer_id q = g.node({b}, {k_bytes}, {}, 1)[0];

  SUBCASE("cut apart") {
    env.sim->run_until_idle();
    for (buffer_id id : {a, b, m}) drop(env, id);
    CHECK(neighbourhood(env, r) == 1110);
    CHECK(neighbourhood(env, q) == 1110);
    g.expect(m);  // m comes back; a and b are not connected any more
    env.sim->run_until_idle();
    CHECK(neighbourhood(env, m) == 1010);
    CHECK(neighbourhood(env, r) == 10);
    CHECK(neighbourhood(env, q) == 1000);
    drop(env, m);  // one set again
    CHECK(neighbourhood(env, r) == 1110);
    CHECK(neighbourhood(env, q) == 1110);
  }
  SUBCASE("still joined through z = f(a, b)") {
    const buffer_id z = g.node({a, b}, {k_bytes}, {}, 5)[0];
    env.sim->run_until_idle();
    for (buffer_id id : {a, b, m, z}) drop(env, id);
    CHECK(neighbourhood(env, r) == 1115);
    g.expect(m);
    env.sim->run_until_idle();
    CHECK(neighbourhood(env, m) == 1015);
    CHECK(neighbourhood(env, r) == 1015);
    CHECK(neighbourhood(env, q) == 1015);
  }
  env.check_clean();
}

TEST_CASE("a node's outputs: one set when dropped, its cost counted once, never charged to a sibling twice") {
  // n = f(s) has outputs a and b; x reads a, y reads b, z reads x and y. s has lineage of its
  // own (a source cannot be dropped, so it is described without a neighbourhood).
  engine_env env(drop_only());
  lineage_graph g(env);
  const buffer_id s = g.node({g.source(k_bytes)}, {k_bytes}, {}, 1)[0];
  const std::vector<buffer_id> ab = g.node({s}, {k_bytes, k_bytes}, {}, 1000);
  const buffer_id a = ab[0];
  const buffer_id b = ab[1];
  const buffer_id x = g.node({a}, {k_bytes}, {}, 10)[0];
  const buffer_id y = g.node({b}, {k_bytes}, {}, 20)[0];
  const buffer_id z = g.node({x, y}, {k_bytes}, {}, 5)[0];
  env.sim->run_until_idle();

  drop(env, a);
  CHECK(neighbourhood(env, s) == 1000);
  CHECK(neighbourhood(env, x) == 1000);
  CHECK(neighbourhood(env, b) == 0);  // dropping b as well runs n once more, not twice: adds nothing
  drop(env, b);                       // {a, b}: one set, n once
  CHECK(neighbourhood(env, s) == 1000);
  CHECK(neighbourhood(env, x) == 1000);
  CHECK(neighbourhood(env, y) == 1000);

  SUBCASE("the sibling left keeps the node's cost when the other is forgotten") {
    g.forget(z);
    g.forget(x);
    g.forget(a);  // nothing reads it now: it leaves the graph
    env.sim->run_until_idle();
    CHECK(neighbourhood(env, s) == 1000);
    CHECK(neighbourhood(env, y) == 1000);
  }
  SUBCASE("dropped with the outputs' readers: one set, each node once") {
    drop(env, x);
    drop(env, y);
    CHECK(neighbourhood(env, s) == 1030);
    CHECK(neighbourhood(env, z) == 1030);
    g.expect(x);  // runs n (a and b come back), then x: {y} is left
    env.sim->run_until_idle();
    CHECK(neighbourhood(env, b) == 20);
    CHECK(neighbourhood(env, a) == 0);
    CHECK(neighbourhood(env, s) == 0);
    CHECK(neighbourhood(env, z) == 20);
  }
  env.check_clean();
}

TEST_CASE("forgetting a dropped buffer that joined two sets cuts them apart") {
  // z = f(a, b) with a, b, z dropped: one set. z is read by nothing, so forgetting it frees it.
  engine_env env(drop_only());
  lineage_graph g(env);
  const buffer_id s1 = g.source(k_bytes);
  const buffer_id s2 = g.source(k_bytes);
  const buffer_id a = g.node({s1}, {k_bytes}, {}, 10)[0];
  const buffer_id b = g.node({s2}, {k_bytes}, {}, 1000)[0];
  const buffer_id z = g.node({a, b}, {k_bytes}, {}, 5)[0];
  const buffer_id r = g.node({a}, {k_bytes}, {}, 1)[0];
  const buffer_id q = g.node({b}, {k_bytes}, {}, 1)[0];
  env.sim->run_until_idle();
  for (buffer_id id : {a, b, z}) drop(env, id);
  CHECK(neighbourhood(env, r) == 1015);
  CHECK(neighbourhood(env, q) == 1015);
  env.eng().forget(z);
  CHECK(neighbourhood(env, r) == 10);
  CHECK(neighbourhood(env, q) == 1000);
  env.eng().forget(q);  // b's set loses its last neighbour; r's is untouched
  CHECK(neighbourhood(env, r) == 10);
  g.expect(a);
  env.sim->run_until_idle();
  CHECK(neighbourhood(env, r) == 0);
  env.check_clean();
}

TEST_CASE("set_lineage: the neighbourhood follows the new producer") {
  engine_env env(drop_only());
  lineage_graph g(env);
  const buffer_id s = g.source(k_bytes);
  const buffer_id a = g.node({s}, {k_bytes}, {}, 10)[0];
  const buffer_id b = g.node({a}, {k_bytes}, {}, 20)[0];
  const buffer_id c = g.node({s}, {k_bytes}, {}, 300)[0];
  const std::vector<buffer_id> two = g.node({c}, {k_bytes, k_bytes}, {}, 40);
  const node_id n2 = g.nodes().back().id;
  env.sim->run_until_idle();
  env.eng().forget(two[1]);  // frees output slot 1 of n2
  drop(env, a);
  CHECK(neighbourhood(env, b) == 10);
  CHECK(env.eng().describe_candidate(b)->cost_ns == 20);
  env.eng().set_lineage(b, n2, 1);  // b = output 1 of n2(c) now: a is no neighbour of it
  CHECK(neighbourhood(env, b) == 0);
  CHECK(env.eng().describe_candidate(b)->cost_ns == 40);
  drop(env, c);
  CHECK(neighbourhood(env, b) == 300);
  CHECK(neighbourhood(env, two[0]) == 300);
}

TEST_CASE("a decision finds the one cheap victim among many, as its neighbourhood changes") {
  // 128 buffers of 16 KiB fill the one 2 MiB small-pool segment the budget allows: a source s,
  // y = fy(s) and 125 others from s, all costing 1 ms, and x = fx(y) costing 10 ns, the only
  // cheap victim. x becomes a candidate again while y is dropped, so it costs y's node too and
  // is no cheaper than the rest; brought back, y leaves x cheap again. Then one more allocation must evict one buffer: DTR's sample of
  // ceil(sqrt(127)) = 12 would find x about one time in ten, and finds it every time because the
  // engine's order by cost per byte followed x's neighbourhood both ways and x joins the sample.
  constexpr std::size_t bytes = 16 * KiB;
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    CAPTURE(seed);
    engine_options o = drop_only();
    o.budget = 2 * MiB;
    o.engine.policy = "dtr";
    o.engine.seed = seed;
    engine_env env(o);
    lineage_graph g(env);
    const buffer_id s = g.source(bytes);
    const buffer_id y = g.node({s}, {bytes}, {}, 1e6)[0];
    const buffer_id x = g.node({y}, {bytes}, {}, 10)[0];
    std::vector<buffer_id> others;
    for (int i = 0; i < 125; ++i) others.push_back(g.node({s}, {bytes}, {}, 1e6)[0]);
    env.sim->run_until_idle();
    {
      const pinned_buffer held = env.eng().pin(x);  // x comes back as a candidate after y is dropped
      drop(env, y);
    }
    CHECK(neighbourhood(env, x) == 1e6);
    g.expect(y);  // recomputes y into its own hole
    env.sim->run_until_idle();
    CHECK(neighbourhood(env, x) == 0);

    void* p = env.alloc->allocate(bytes, stream_ref{});  // full: one eviction makes room
    CHECK(env.eng().state(x) == buffer_state::dropped);
    CHECK(env.eng().state(y) == buffer_state::resident);
    for (buffer_id id : others) CHECK(env.eng().state(id) == buffer_state::resident);
    env.alloc->deallocate(p);
    g.expect(x);  // and x comes back intact
    env.sim->run_until_idle();
    env.check_clean();
  }
}

TEST_CASE("random graphs: every candidate's neighbourhood cost equals one computed from scratch") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    engine_env env(drop_only());
    lineage_graph g(env, 10);
    std::mt19937_64 rng(seed);
    std::map<int, double> node_cost;  // lineage_graph node index -> cost
    std::vector<buffer_id> ids;
    for (int i = 0; i < 3; ++i) ids.push_back(g.source(k_bytes));

    // From scratch: the dropped buffers' connected sets (a node's inputs and outputs are adjacent,
    // and so are its outputs), each costing its members' distinct nodes; for each other buffer,
    // the distinct nodes of the sets next to it other than its own producer, summed.
    const auto check_all = [&] {
      const auto& bufs = g.buffers();
      const std::size_t n = bufs.size();
      std::vector<bool> dropped(n);
      for (std::size_t i = 0; i < n; ++i) dropped[i] = env.eng().state(bufs[i].id) == buffer_state::dropped;
      std::vector<std::vector<std::size_t>> adjacent(n);
      const auto link = [&](int u, int v) {
        adjacent[static_cast<std::size_t>(u)].push_back(static_cast<std::size_t>(v));
        adjacent[static_cast<std::size_t>(v)].push_back(static_cast<std::size_t>(u));
      };
      for (const auto& node : g.nodes()) {
        for (int in : node.inputs) {
          for (int out : node.outputs) link(in, out);
        }
        for (std::size_t j = 0; j < node.outputs.size(); ++j) {
          for (std::size_t k = j + 1; k < node.outputs.size(); ++k) link(node.outputs[j], node.outputs[k]);
        }
      }
      std::vector<std::size_t> set(n, n);  // component id of each dropped buffer
      std::vector<std::set<int>> set_nodes;
      for (std::size_t i = 0; i < n; ++i) {
        if (!dropped[i] || set[i] != n) continue;
        const std::size_t id = set_nodes.size();
        set_nodes.emplace_back();
        std::vector<std::size_t> stack{i};
        set[i] = id;
        while (!stack.empty()) {
          const std::size_t v = stack.back();
          stack.pop_back();
          set_nodes[id].insert(bufs[v].node);
          for (std::size_t w : adjacent[v]) {
            if (dropped[w] && set[w] == n) {
              set[w] = id;
              stack.push_back(w);
            }
          }
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        const std::optional<eviction::candidate_info> c = env.eng().describe_candidate(bufs[i].id);
        if (!c || bufs[i].node < 0) continue;
        std::vector<std::size_t> next;
        for (std::size_t w : adjacent[i]) {
          if (dropped[w] && std::find(next.begin(), next.end(), set[w]) == next.end()) next.push_back(set[w]);
        }
        double expected = 0;
        for (std::size_t k : next) {
          for (int node : set_nodes[k]) expected += node == bufs[i].node ? 0 : node_cost.at(node);
        }
        CHECK_MESSAGE(c->neighbourhood_cost_ns == doctest::Approx(expected).epsilon(1e-9),
                      "buffer index " << i);
      }
    };

    for (int step = 0; step < 120; ++step) {
      const int what = static_cast<int>(rng() % 10);
      if (what < 4 || ids.size() < 6) {  // a node over 1-3 random inputs (one may repeat)
        std::vector<buffer_id> inputs;
        const std::size_t k = 1 + rng() % 3;
        for (std::size_t j = 0; j < k; ++j) inputs.push_back(ids[rng() % ids.size()]);
        const std::size_t outs = 1 + rng() % 3;  // up to 3: brought back with two dropped siblings
        const double cost = static_cast<double>(1 + rng() % 1000);
        const std::vector<buffer_id> out =
            g.node(inputs, std::vector<std::size_t>(outs, k_bytes), {}, cost);
        node_cost[static_cast<int>(g.nodes().size()) - 1] = cost;
        ids.insert(ids.end(), out.begin(), out.end());
      } else if (what < 8) {  // drop a resident buffer with lineage
        const buffer_id id = ids[rng() % ids.size()];
        if (g.at(id).node >= 0 && env.eng().state(id) == buffer_state::resident) drop(env, id);
      } else {  // bring one back (and what it needs)
        const buffer_id id = ids[rng() % ids.size()];
        g.expect(id);
      }
      env.sim->run_until_idle();
      check_all();
    }
    env.check_clean();
  }
}

TEST_CASE("cheapest_to_drop: droppable candidates by cost per byte, never one that can only spill") {
  // Hybrid mode. s (a source: spill only), three nodes over it of 1 ms, 10 us and 100 us on 16 KiB,
  // and a 64 KiB buffer registered without lineage (spill only, and the cheapest per byte to
  // spill): the order is by what dropping costs, and the two that cannot drop are not in it.
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(16 * KiB);
  const buffer_id dear = g.node({s}, {16 * KiB}, {}, 1e6)[0];
  const buffer_id cheap = g.node({s}, {16 * KiB}, {}, 1e4)[0];
  const buffer_id mid = g.node({s}, {16 * KiB}, {}, 1e5)[0];
  const buffer_id big = g.source(64 * KiB);
  env.sim->run_until_idle();
  CHECK(env.eng().cheapest_to_drop(16) == std::vector<buffer_id>{cheap, mid, dear});
  CHECK(env.eng().cheapest_to_drop(2) == std::vector<buffer_id>{cheap, mid});
  CHECK(env.eng().cheapest_to_drop(0).empty());
  {
    const pinned_buffer held = env.eng().pin(cheap);  // pinned: not a candidate
    CHECK(env.eng().cheapest_to_drop(16) == std::vector<buffer_id>{mid, dear});
  }
  for (buffer_id id : {s, big, dear, cheap, mid}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}

TEST_CASE("cheapest_to_drop: set_lineage moves a candidate in the order, in or out of it") {
  // As above: a source s, two nodes over it of 1 ms and 100 us, and a 16 KiB source t (spill only,
  // so not in the order). set_lineage gives t a 10 us producer: it can be dropped, the cheapest;
  // then a 10 ms one: the dearest.
  engine_env env;
  lineage_graph g(env);
  const buffer_id s = g.source(16 * KiB);
  const buffer_id dear = g.node({s}, {16 * KiB}, {}, 1e6)[0];
  const buffer_id mid = g.node({s}, {16 * KiB}, {}, 1e5)[0];
  const buffer_id t = g.source(16 * KiB);
  env.sim->run_until_idle();
  REQUIRE(env.eng().cheapest_to_drop(16) == std::vector<buffer_id>{mid, dear});
  const auto noop = [](std::span<void* const>, std::span<void* const>, stream_ref) {};
  env.eng().set_lineage(t, env.eng().add_node({.name = "cheap", .inputs = {s}, .compute = noop, .cost_ns = 1e4}));
  CHECK(env.eng().cheapest_to_drop(16) == std::vector<buffer_id>{t, mid, dear});
  env.eng().set_lineage(t, env.eng().add_node({.name = "dearest", .inputs = {s}, .compute = noop, .cost_ns = 1e7}));
  CHECK(env.eng().cheapest_to_drop(16) == std::vector<buffer_id>{mid, dear, t});
  for (buffer_id id : {s, dear, mid, t}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}
