// test_pressure_release: step 3 of Note [Memory pressure path]: before any pressure handler is
// asked, the allocator gives back free cached segments (or, with expandable segments, free
// granules) that cover the budget's shortfall, and only as many as needed.
//
// It proves: a request over the budget that cached memory covers is served without a handler
// call, with one release (one device synchronisation); the smallest segment that covers the
// shortfall alone goes, or else the largest first until it is covered, and the rest stays cached;
// with expandable segments free granules anywhere are unmapped to cover it. (Free cache that does
// not cover the shortfall is kept while the handlers are asked: test_pressure_handlers.cpp.)
// And step 6: a small request that nothing else serves takes a free block of the large pool.
#include <doctest/doctest.h>

#include <cstring>
#include <initializer_list>
#include <memory>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"

using namespace spillway;
using namespace spillway::test;


namespace {

// A live 12 MiB block on `s` and free cached segments of `sizes` MiB, under `budget_mib`, with a
// handler that only counts its calls (it has nothing to evict).
struct cached_under_budget {
  std::unique_ptr<backend_env> env = make_sim_env();
  std::unique_ptr<device_allocator> alloc;
  stream_ref s = env->new_stream();
  void* a = nullptr;
  int calls = 0;

  cached_under_budget(std::size_t budget_mib, std::initializer_list<std::size_t> sizes) {
    allocator_config c = env->config();
    c.budget = budget_mib * MiB;
    alloc = std::make_unique<device_allocator>(env->backend, c);
    a = alloc->allocate(12 * MiB, s);
    std::vector<void*> blocks;
    for (std::size_t mib : sizes) blocks.push_back(alloc->allocate(mib * MiB, s));
    for (void* p : blocks) alloc->deallocate(p);
    alloc->add_pressure_handler([this](const pressure_request&) {
      ++calls;
      return pressure_result{0, 0};
    });
  }
};

}  // namespace

TEST_CASE("free cached segments that cover the shortfall are given back before any handler runs") {
  cached_under_budget u(30, {12});  // 24 MiB reserved, 12 allocated
  const memory_stats before = u.alloc->stats();
  // 14 MiB fits no cached block, and a new segment would be 8 MiB over the budget: releasing
  // the cached 12 MiB covers that. The handler is not asked (it would have to evict `a`, a live
  // activation, for memory the cache already holds).
  void* c = u.alloc->allocate(14 * MiB, u.s);
  const memory_stats st = u.alloc->stats();
  CHECK(u.calls == 0);
  CHECK(u.alloc->owns(u.a));
  CHECK(st.num_releases_before_eviction == before.num_releases_before_eviction + 1);
  CHECK(st.num_sync_all_streams == before.num_sync_all_streams + 1);  // the release's one sync
  CHECK(st.num_device_free == before.num_device_free + 1);
  CHECK(st.num_pressure_handler_calls == before.num_pressure_handler_calls);
  CHECK(st.reserved_bytes[0].current == static_cast<std::int64_t>(26 * MiB));
  check_consistent(*u.alloc);
  u.alloc->deallocate(c);
  u.alloc->deallocate(u.a);
}

namespace {

// Cached segments of `sizes` MiB under `budget_mib` (a live 12 MiB block besides): a request of
// `request_mib` is served by releasing `released` of them, without a handler call, and a request of
// `kept_mib` afterwards by the segment that stayed cached (no new device allocation).
void check_release(std::size_t budget_mib, std::initializer_list<std::size_t> sizes,
                   std::size_t request_mib, std::size_t released, std::size_t reserved_mib,
                   std::size_t kept_mib) {
  cached_under_budget u(budget_mib, sizes);
  const memory_stats before = u.alloc->stats();
  void* x = u.alloc->allocate(request_mib * MiB, u.s);
  const memory_stats st = u.alloc->stats();
  CHECK(u.calls == 0);
  CHECK(st.num_releases_before_eviction == before.num_releases_before_eviction + 1);
  CHECK(st.num_sync_all_streams == before.num_sync_all_streams + 1);
  CHECK(st.num_device_free == before.num_device_free + released);
  CHECK(st.reserved_bytes[0].current == static_cast<std::int64_t>(reserved_mib * MiB));
  void* y = u.alloc->allocate(kept_mib * MiB, u.s);
  CHECK(u.alloc->stats().num_device_alloc == before.num_device_alloc + 1);
  check_consistent(*u.alloc);
  for (void* p : {x, y, u.a}) u.alloc->deallocate(p);
}

}  // namespace

TEST_CASE("that release gives back only what covers the shortfall: the smallest segment that does alone") {
  // 40 MiB reserved; 18 MiB is 10 MiB over: the 12 MiB segment covers it and goes, 16 stays.
  check_release(48, {12, 16}, 18, 1, 46, 16);
}

TEST_CASE("that release gives back the largest segments first when none covers the shortfall alone") {
  // 48 MiB reserved; 26 MiB is 24 MiB over: 14 + 12 cover it and go, 10 stays.
  check_release(50, {10, 12, 14}, 26, 2, 48, 10);
}

TEST_CASE("with expandable segments, free granules that cover the shortfall are unmapped before any handler runs") {
  auto env = make_sim_env();
  const std::size_t g = env->backend->vmm_granularity();
  REQUIRE(g > 0);
  device_allocator alloc(env->backend, env->expandable_config(6 * g));
  void* a = alloc.allocate(2 * g);
  void* b = alloc.allocate(2 * g);
  void* d = alloc.allocate(g);
  void* e = alloc.allocate(g);  // 6 granules mapped: the budget
  alloc.deallocate(a);          // 2 + 1 free granules, apart: no free block holds 3
  alloc.deallocate(d);
  int calls = 0;
  alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    alloc.deallocate(b);
    return pressure_result{2 * g, 0};
  });
  const memory_stats before = alloc.stats();
  void* x = alloc.allocate(3 * g);  // 3 new granules, 3 over: the free ones cover that
  const memory_stats st = alloc.stats();
  CHECK(calls == 0);
  CHECK(alloc.owns(b));
  CHECK(st.num_releases_before_eviction == before.num_releases_before_eviction + 1);
  CHECK(st.reserved_bytes[0].current <= static_cast<std::int64_t>(6 * g));
  check_consistent(alloc);
  alloc.deallocate(x);
  alloc.deallocate(b);
  alloc.deallocate(e);
}

TEST_CASE("a small request takes a free block of the large pool once no segment fits the budget") {
  // Step 6: a 3 MiB block holds a 20 MiB large segment, the budget is 20 MiB, and a 4 KiB request
  // wants a 2 MiB small segment. Nothing can be released or evicted: the request is served from
  // the large segment's free 17 MiB, and when freed that block merges back into it.
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.budget = 20 * MiB;
  device_allocator alloc(env->backend, c);
  const stream_ref s = env->new_stream();
  int calls = 0;
  alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    return pressure_result{0, 0};
  });
  void* big = alloc.allocate(3 * MiB, s);
  REQUIRE(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(20 * MiB));
  void* small = alloc.allocate(4096, s);
  const memory_stats st = alloc.stats();
  CHECK(st.num_small_from_large == 1);
  CHECK(calls == 1);  // the handlers were asked first
  CHECK(st.reserved_bytes[0].current == static_cast<std::int64_t>(20 * MiB));
  const int large = static_cast<int>(stat_type::large_pool);
  CHECK(st.allocation[large].current == 2);  // counted where its memory is
  CHECK(alloc.describe(small).segment_base == alloc.describe(big).segment_base);
  check_stats_match_snapshot(st, alloc.snapshot());
  std::memset(small, 0x5a, 4096);  // real bytes on the simulated device
  alloc.deallocate(small);
  alloc.deallocate(big);
  const memory_stats after = alloc.stats();
  CHECK(after.allocated_bytes[0].current == 0);
  CHECK(after.allocation[large].current == 0);
  CHECK(alloc.largest_free_block() == 20 * MiB);  // merged back whole
  check_snapshot_invariants(alloc.snapshot());
}

TEST_CASE("with expandable segments a small request grows its own pool instead") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.budget = 8 * MiB;
  c.expandable_segments = true;
  device_allocator alloc(env->backend, c);
  const stream_ref s = env->new_stream();
  void* big = alloc.allocate(3 * MiB, s);
  void* small = alloc.allocate(4096, s);
  CHECK(alloc.stats().num_small_from_large == 0);
  alloc.deallocate(small);
  alloc.deallocate(big);
}
