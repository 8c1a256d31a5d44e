// test_engine_pressure: the engine as the allocator's pressure handler, for every policy.
//
// It proves, for each of policy_names() (the same conformance checks): an allocation over the
// budget makes the engine evict until it fits, and every evicted buffer comes back intact; pinned
// buffers are never evicted, and the out_of_memory that follows names the pinned bytes; buffers
// registered as not evictable are never evicted (not even by an explicit evict); lowering the
// budget asks the engine to evict; through all of it the allocator's snapshot tiles its segments
// and matches its statistics, and forgetting everything brings the allocator back to zero.
// And that dtr-frag serves a large request by evicting adjacent buffers (the least bytes), where
// lru, largest and dtr evict scattered ones first; and that a small request needing a new segment
// under a full budget is served by one eviction of a block that is its whole segment, where
// scattered evictions from a shared segment ran out of rounds (out of memory) before.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// 4 sources and 20 nodes (chains and diamonds, some with two outputs) of 64 KiB words, 1.5 MiB
// on the default stream and a 2 MiB budget.
struct workload {
  engine_env env;
  lineage_graph g{env};
  std::vector<buffer_id> ids;

  explicit workload(const std::string& policy) : env(options(policy)) {
    for (int i = 0; i < 4; ++i) ids.push_back(g.source(64 * KiB));
    for (int i = 0; ids.size() < 24; ++i) {
      const buffer_id a = ids[ids.size() - 1];
      const buffer_id b = ids[static_cast<std::size_t>(i * 7) % ids.size()];
      const std::vector<buffer_id> out =
          i % 3 == 0 ? g.node({a, b}, {64 * KiB, 64 * KiB}, {}, 500.0 * (i + 1))
                     : g.node({a}, {64 * KiB}, {}, 500.0 * (i + 1));
      ids.insert(ids.end(), out.begin(), out.end());
    }
    env.sim->run_until_idle();
  }
  static engine_options options(const std::string& policy) {
    engine_options o;
    o.budget = 2 * MiB;
    o.engine.policy = policy;
    return o;
  }
  void expect_all() {
    for (buffer_id id : ids) g.expect(id);
    env.sim->run_until_idle();
  }
  void check_allocator() const {
    const memory_snapshot snap = env.alloc->snapshot();
    check_snapshot_invariants(snap);
    check_stats_match_snapshot(env.alloc->stats(), snap);
  }
};

}  // namespace

TEST_CASE("every policy: an allocation over budget evicts until it fits; the evicted come back") {
  for (const std::string& policy : eviction::policy_names()) {
    CAPTURE(policy);
    workload w(policy);
    REQUIRE(w.env.eng().stats().evictions == 0);
    void* big = w.env.alloc->allocate(MiB);  // a contiguous MiB in a full 2 MiB segment
    CHECK(w.env.eng().stats().evictions > 0);
    CHECK(w.env.eng().stats().pressure_calls > 0);
    CHECK(w.env.alloc->stats().reserved_bytes[0].current <= static_cast<std::int64_t>(2 * MiB));
    w.env.sim->launch({}, 100, [big] { std::memset(big, 0x5A, MiB); });
    w.check_allocator();
    w.env.alloc->deallocate(big);
    w.expect_all();
    w.env.check_clean();
    CHECK(w.env.log.checks() == w.ids.size());
    // Everything forgotten: the allocator is back to zero.
    w.g.forget_all();
    w.env.sim->run_until_idle();
    CHECK(w.env.allocated_bytes() == 0);
    CHECK(w.env.eng().stats().registered == 0);
    w.check_allocator();
  }
}

TEST_CASE("every policy: pinned buffers are never evicted; out_of_memory names the pinned bytes") {
  for (const std::string& policy : eviction::policy_names()) {
    CAPTURE(policy);
    workload w(policy);
    std::vector<pinned_buffer> pins;
    for (buffer_id id : w.ids) pins.push_back(w.env.eng().pin(id));
    const auto pinned = w.env.eng().stats().pinned_bytes;
    CHECK(pinned == 24 * 64 * KiB);
    try {
      (void)w.env.alloc->allocate(MiB);
      FAIL("the allocation fit although every buffer is pinned");
    } catch (const out_of_memory& e) {
      CHECK(e.info().pinned == pinned);
      CHECK_MESSAGE(contains(e.what(), format_bytes(pinned) + " are pinned"), e.what());
    }
    CHECK(w.env.eng().stats().evictions == 0);
    for (std::size_t i = 0; i < w.ids.size(); ++i) {
      CHECK(w.env.eng().state(w.ids[i]) == buffer_state::resident);
      w.g.check_kernel(w.ids[i], pins[i].get(), {});
    }
    w.env.sim->run_until_idle();
    // The second half unpinned (the end of the segment): those may go, the others stay put.
    for (std::size_t i = 12; i < pins.size(); ++i) pins[i].reset();
    void* big = w.env.alloc->allocate(MiB);
    CHECK(w.env.eng().stats().evictions > 0);
    for (std::size_t i = 0; i < 12; ++i) {
      CHECK(w.env.eng().state(w.ids[i]) == buffer_state::resident);
      CHECK(w.env.eng().pin(w.ids[i]).get() == pins[i].get());
    }
    w.env.alloc->deallocate(big);
    pins.clear();
    w.expect_all();
    w.env.check_clean();
  }
}

TEST_CASE("every policy: buffers that are not evictable are never evicted") {
  for (const std::string& policy : eviction::policy_names()) {
    CAPTURE(policy);
    engine_options o = workload::options(policy);
    engine_env env(o);
    lineage_graph g(env);
    std::vector<buffer_id> fixed, free;
    for (int i = 0; i < 12; ++i) fixed.push_back(g.source(64 * KiB, {}, {.evictable = false}));
    for (int i = 0; i < 12; ++i) free.push_back(g.source(64 * KiB));
    env.sim->run_until_idle();
    CHECK_FALSE(env.eng().evict(fixed[0]));  // an explicit evict refuses, too
    CHECK_FALSE(env.eng().evict(fixed[1], eviction_mode::spill));
    void* big = env.alloc->allocate(MiB);
    CHECK(env.eng().stats().evictions > 0);
    for (buffer_id id : fixed) CHECK(env.eng().state(id) == buffer_state::resident);
    env.alloc->deallocate(big);
    for (buffer_id id : fixed) g.expect(id);
    for (buffer_id id : free) g.expect(id);
    env.sim->run_until_idle();
    env.check_clean();
  }
}

TEST_CASE("every policy: lowering the budget asks the engine to evict") {
  for (const std::string& policy : eviction::policy_names()) {
    CAPTURE(policy);
    engine_options o = workload::options(policy);
    o.budget = 8 * MiB;
    o.streams = 3;
    engine_env env(o);
    lineage_graph g(env);
    std::vector<buffer_id> ids;
    // Four streams: four small segments of 2 MiB, 1 MiB of buffers in each.
    const std::vector<stream_ref> streams = {stream_ref{}, env.stream(0), env.stream(1), env.stream(2)};
    for (int i = 0; i < 32; ++i) {
      const stream_ref s = streams[static_cast<std::size_t>(i % 4)];
      ids.push_back(i < 4 ? g.source(128 * KiB, s) : g.node({ids[static_cast<std::size_t>(i - 4)]}, {128 * KiB}, s)[0]);
    }
    env.sim->run_until_idle();
    REQUIRE(env.alloc->stats().reserved_bytes[0].current == static_cast<std::int64_t>(8 * MiB));
    const budget_report r = env.alloc->set_budget(4 * MiB);
    CHECK(r.budget == 4 * MiB);
    CHECK(env.eng().stats().evictions > 0);
    CHECK(env.eng().stats().pressure_calls > 0);
    CHECK(env.alloc->stats().reserved_bytes[0].current <
          static_cast<std::int64_t>(8 * MiB));
    env.alloc->set_budget(8 * MiB);
    for (buffer_id id : ids) g.expect(id);
    env.sim->run_until_idle();
    env.check_clean();
    g.forget_all();
    env.sim->run_until_idle();
    CHECK(env.allocated_bytes() == 0);
  }
}

TEST_CASE("allow_spill = false drops only; allow_drop = false spills only") {
  for (const bool spill : {false, true}) {
    CAPTURE(spill);
    engine_options o = workload::options("dtr-frag");
    o.engine.allow_spill = spill;
    o.engine.allow_drop = !spill;
    engine_env env(o);
    lineage_graph g(env);
    std::vector<buffer_id> sources, outs;
    for (int i = 0; i < 4; ++i) sources.push_back(g.source(64 * KiB));
    for (int i = 0; i < 16; ++i) outs.push_back(g.node({sources[i % 4]}, {64 * KiB})[0]);
    env.sim->run_until_idle();
    CHECK(env.eng().evict(outs[0], eviction_mode::drop) == !spill);
    CHECK(env.eng().evict(outs[1], eviction_mode::spill) == spill);
    CHECK(env.eng().evict(sources[0]) == spill);  // no lineage: only a spill can evict it
    void* big = env.alloc->allocate(MiB);  // over budget: evictions of the allowed kind
    const auto st = env.eng().stats();
    CHECK(st.evictions > 3);
    CHECK((spill ? st.drops : st.spills) == 0);
    env.alloc->deallocate(big);
    for (buffer_id id : sources) g.expect(id);
    for (buffer_id id : outs) g.expect(id);
    env.sim->run_until_idle();
    env.check_clean();
  }
}

// Eight buffers tiling one 20 MiB segment, big (3 MiB) and small (2 MiB) in turn, the big ones the
// least recently used: a 5 MiB request is served by one big buffer and a small neighbour.
struct layout_result {
  std::size_t evicted_bytes = 0;
  std::vector<std::size_t> evicted;  // positions in address order
};

layout_result evict_for_five_mib(const std::string& policy) {
  engine_options o;
  o.budget = 22 * MiB;  // a small segment for the source, and the 20 MiB one
  o.engine.policy = policy;
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id z = g.source(4 * KiB);
  pinned_buffer hold_z = env.eng().pin(z);  // only the large buffers are candidates
  std::vector<buffer_id> ids;
  for (int i = 0; i < 8; ++i) {
    const std::size_t bytes = i % 2 == 0 ? 3 * MiB : 2 * MiB;
    ids.push_back(g.node({z}, {bytes}, {}, 100, {{.mode = eviction_mode::drop}})[0]);
  }
  env.sim->run_until_idle();
  // Address order is creation order, in one segment.
  std::vector<void*> ptrs;
  for (buffer_id id : ids) ptrs.push_back(env.eng().pin(id).get());
  for (std::size_t i = 1; i < ptrs.size(); ++i) REQUIRE(ptrs[i] > ptrs[i - 1]);
  REQUIRE(env.alloc->stats().segment[2].current == 1);
  for (std::size_t i = 1; i < ids.size(); i += 2) (void)env.eng().pin(ids[i]);  // smalls: recent

  void* p = env.alloc->allocate(5 * MiB);
  layout_result r;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (env.eng().state(ids[i]) != buffer_state::resident) {
      r.evicted.push_back(i);
      r.evicted_bytes += env.eng().size(ids[i]);
    }
  }
  env.alloc->deallocate(p);
  hold_z.reset();
  for (buffer_id id : ids) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
  return r;
}

TEST_CASE("dtr-frag serves a large request from adjacent victims; the others scatter first") {
  const layout_result frag = evict_for_five_mib("dtr-frag");
  CHECK(frag.evicted_bytes == 5 * MiB);
  REQUIRE(frag.evicted.size() == 2);
  CHECK(frag.evicted[1] == frag.evicted[0] + 1);  // neighbours
  for (const std::string& policy : {std::string("lru"), std::string("largest"), std::string("dtr")}) {
    CAPTURE(policy);
    const layout_result other = evict_for_five_mib(policy);
    CHECK(other.evicted_bytes > frag.evicted_bytes);
  }
}

namespace {

// A small-pool request that needs a new 2 MiB segment, under a budget equal to what is reserved:
// a 20 MiB segment full of ten stale 2 MiB buffers, a 12 MiB buffer that is its whole segment,
// and a small segment whose buffers are pinned. Returns the evictions the request took, or throws.
struct segment_trap {
  engine_env env;
  lineage_graph g{env};
  std::vector<buffer_id> medium;
  buffer_id big;
  std::vector<pinned_buffer> holds;

  explicit segment_trap(const std::string& policy) : env(options(policy)) {
    std::vector<buffer_id> sources;
    for (int i = 0; i < 4; ++i) sources.push_back(g.source(512 * KiB));  // the small segment
    for (int i = 0; i < 10; ++i) medium.push_back(g.node({sources[0]}, {2 * MiB})[0]);
    env.sim->run_until_idle();
    env.sim->advance(1'000'000);  // the medium buffers are stale: DTR's favourite victims
    big = g.node({sources[1]}, {12 * MiB})[0];
    env.sim->run_until_idle();
    for (buffer_id s : sources) holds.push_back(env.eng().pin(s));
    env.alloc->set_budget(static_cast<std::size_t>(env.alloc->stats().reserved_bytes[0].current));
  }
  static engine_options options(const std::string& policy) {
    engine_options o;
    o.engine.policy = policy;
    o.engine.allow_spill = false;
    return o;
  }
};

}  // namespace

TEST_CASE("dtr-frag: a request that needs a new segment evicts a whole segment, not scattered blocks") {
  segment_trap t("dtr-frag");
  REQUIRE(t.env.alloc->stats().reserved_bytes[0].current == static_cast<std::int64_t>(34 * MiB));
  const auto before = t.env.eng().stats().evictions;
  void* p = t.env.alloc->allocate(512 * KiB);  // a new small segment: 2 MiB over the budget
  CHECK(t.env.eng().stats().evictions == before + 1);
  CHECK(t.env.eng().state(t.big) == buffer_state::dropped);
  for (buffer_id id : t.medium) CHECK(t.env.eng().state(id) == buffer_state::resident);
  CHECK(t.env.alloc->stats().reserved_bytes[0].current <= static_cast<std::int64_t>(34 * MiB));
  t.env.alloc->deallocate(p);
  t.holds.clear();
  t.env.alloc->set_budget(unlimited_budget);
  for (buffer_id id : t.medium) t.g.expect(id);
  t.g.expect(t.big);
  t.env.sim->run_until_idle();
  t.env.check_clean();
}

TEST_CASE("expandable segments: a round ends once the granules it frees cover the shortfall") {
  // Three 4 MiB sources fill 12 MiB of a 16 MiB budget. A 6 MiB request is 2 MiB over it: the
  // oldest source's 4 MiB of whole granules cover that (they are unmapped and mapped again where
  // the request goes), so one eviction serves it. Counting freed bytes against the request's 6 MiB
  // would have evicted a second source.
  engine_options o;
  o.budget = 16 * MiB;
  o.expandable_segments = true;
  o.engine.policy = "lru";
  engine_env env(o);
  lineage_graph g(env);
  // The sources share one mapped run (12 MiB mapped first, then freed): none is a whole segment.
  env.alloc->deallocate(env.alloc->allocate(12 * MiB));
  std::vector<buffer_id> sources;
  for (int i = 0; i < 3; ++i) sources.push_back(g.source(4 * MiB));
  env.sim->run_until_idle();
  REQUIRE(env.alloc->stats().reserved_bytes[0].current == static_cast<std::int64_t>(12 * MiB));
  REQUIRE(env.alloc->stats().segment[0].current == 1);

  void* p = env.alloc->allocate(6 * MiB);
  CHECK(env.eng().stats().evictions == 1);
  CHECK(env.eng().state(sources[0]) == buffer_state::spilled);
  CHECK(env.eng().state(sources[1]) == buffer_state::resident);
  CHECK(env.eng().state(sources[2]) == buffer_state::resident);
  CHECK(env.alloc->stats().reserved_bytes[0].current <= static_cast<std::int64_t>(16 * MiB));
  env.alloc->deallocate(p);
  for (buffer_id id : sources) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
}
