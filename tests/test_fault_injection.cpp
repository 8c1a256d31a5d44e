// test_fault_injection: device failures injected with sim_device::fail_nth leave the allocator
// intact.
//
// It proves: a segment reservation that fails throws out_of_memory (or succeeds through the
// smaller-segment fallback, or after releasing the cache) and a failed allocation changes nothing:
// statistics, snapshot, live pointers and their bytes are as before, and the next allocation
// works. The same for a failed page map of an expandable segment (a hole whose map fails stays as
// it was, and the top serves the request), for a budget that stops an
// expandable segment from growing, and for a copy that fails (device_error, nothing enqueued).
// Event creation cannot be made to fail on the sim; that path is not tested here.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

struct live_set {
  std::vector<std::pair<void*, std::size_t>> blocks;  // pointer, bytes; id = index + 1

  void add(device_allocator& alloc, std::size_t n, stream_ref s = {}) {
    void* p = alloc.allocate(n, s);
    blocks.emplace_back(p, n);
    fill_pattern(p, n, blocks.size());
  }
  void check(const device_allocator& alloc) const {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      INFO("live block " << i);
      CHECK(alloc.owns(blocks[i].first));
      CHECK(pattern_ok(blocks[i].first, blocks[i].second, i + 1));
    }
  }
  void free_all(device_allocator& alloc) {
    for (auto [p, n] : blocks) CHECK(alloc.deallocate(p) == free_status::freed);
    blocks.clear();
  }
};

// Runs `failing` (which must throw out_of_memory) and checks that nothing else changed.
template <class F>
void check_oom_changes_nothing(device_allocator& alloc, const live_set& live, F failing) {
  const memory_stats before = alloc.stats();
  const memory_snapshot snap_before = alloc.snapshot();
  CHECK_THROWS_AS(failing(), out_of_memory);
  const memory_stats after = alloc.stats();
  check_same_stats(before, after);
  check_same_snapshot(snap_before, alloc.snapshot());
  CHECK(after.num_ooms == before.num_ooms + 1);
  live.check(alloc);
  check_stats_match_snapshot(after, alloc.snapshot());
}

}  // namespace

TEST_CASE("a failed segment reservation throws out_of_memory and changes nothing") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  live_set live;
  live.add(alloc, 3 * MiB);      // a 20 MiB segment, 17 MiB of it cached
  live.add(alloc, 500 * KiB);    // a small segment

  env->sim->fail_nth(fault_site::segment_reservation, 1);
  // 24 MiB fits no cached block; its segment is its own minimum, so there is no smaller try.
  check_oom_changes_nothing(alloc, live, [&] { alloc.allocate(24 * MiB); });
  CHECK(env->sim->counters().faults_injected == 1);

  // The next allocation works.
  live.add(alloc, 24 * MiB);
  live.check(alloc);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
  live.free_all(alloc);
}

TEST_CASE("a failed preferred segment falls back to the smallest one that serves") {
  {
    auto env = make_sim_env();
    device_allocator alloc(env->backend, env->config());
    // A 2 MiB request wants a 20 MiB segment; the device refuses it once, and the allocator asks
    // for 2 MiB instead.
    env->sim->fail_nth(fault_site::segment_reservation, 1);
    void* p = alloc.allocate(2 * MiB);
    CHECK(alloc.describe(p).segment_size == 2 * MiB);
    CHECK(env->sim->counters().faults_injected == 1);
    CHECK(alloc.stats().num_ooms == 0);
    alloc.deallocate(p);
  }
  {  // Both tries refused (the device is too full for 20 MiB, the 2 MiB try is failed):
     // out_of_memory, nothing changed; then the fallback works.
    sim_config sc = default_sim_config();
    sc.capacity = 32 * MiB;
    auto env = make_sim_env(sc);
    device_allocator alloc(env->backend, env->config());
    live_set live;
    live.add(alloc, 3 * MiB);  // 20 of the 32 MiB
    const stream_ref s = env->new_stream();
    env->sim->fail_nth(fault_site::segment_reservation, 2);
    check_oom_changes_nothing(alloc, live, [&] { alloc.allocate(2 * MiB, s); });
    CHECK(env->sim->counters().faults_injected == 1);
    live.add(alloc, 2 * MiB, s);
    CHECK(alloc.describe(live.blocks.back().first).segment_size == 2 * MiB);
    live.check(alloc);
    live.free_all(alloc);
  }
}

TEST_CASE("a failed reservation succeeds after the cache is released") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  live_set live;
  live.add(alloc, 3 * MiB);
  void* cached = alloc.allocate(12 * MiB, env->new_stream());
  alloc.deallocate(cached);  // a fully free 12 MiB segment on another stream
  const std::int64_t frees = alloc.stats().num_device_free;

  env->sim->fail_nth(fault_site::segment_reservation, 1);
  void* p = alloc.allocate(24 * MiB);  // fails once, the cache is released, the retry works
  CHECK(alloc.owns(p));
  CHECK(alloc.stats().num_device_free == frees + 1);  // the cached segment went back
  CHECK(alloc.stats().num_alloc_retries == 1);
  CHECK(alloc.stats().num_ooms == 0);
  live.check(alloc);
  alloc.deallocate(p);
  live.free_all(alloc);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("a failed page map of an expandable segment throws and changes nothing") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.expandable_segments = true;
  device_allocator alloc(env->backend, c);
  const std::size_t g = env->backend->vmm_granularity();
  live_set live;
  live.add(alloc, 2 * g);
  live.add(alloc, 1000);  // the small pool's own segment

  // Growing the existing segment fails.
  env->sim->fail_nth(fault_site::page_map, 1);
  check_oom_changes_nothing(alloc, live, [&] { alloc.allocate(2 * g); });
  CHECK(env->sim->counters().faults_injected == 1);
  // The next growth works, in place.
  live.add(alloc, 2 * g);
  CHECK(static_cast<char*>(live.blocks[2].first) == static_cast<char*>(live.blocks[0].first) + 2 * g);

  // The first map of a new stream's segment fails: no segment is left behind.
  const stream_ref s = env->new_stream();
  env->sim->fail_nth(fault_site::page_map, 1);
  check_oom_changes_nothing(alloc, live, [&] { alloc.allocate(2 * g, s); });
  live.add(alloc, 2 * g, s);
  live.check(alloc);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
  live.free_all(alloc);
  alloc.empty_cache();
  CHECK(alloc.stats().segment[0].current == 0);
  CHECK(alloc.stats().reserved_bytes[0].current == 0);
}

TEST_CASE("a failed map of a hole leaves the hole as it was; the top serves the request instead") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.expandable_segments = true;
  device_allocator alloc(env->backend, c);
  const std::size_t g = env->backend->vmm_granularity();
  live_set live;
  live.add(alloc, g);
  void* middle = alloc.allocate(2 * g);
  live.add(alloc, g);
  alloc.deallocate(middle);
  REQUIRE(alloc.empty_cache() == 2 * g);  // a hole of 2 granules between two live blocks
  const memory_snapshot before = alloc.snapshot();
  REQUIRE(before.segments.size() == 2);

  env->sim->fail_nth(fault_site::page_map, 1);  // the hole's map fails; the top's succeeds
  live.add(alloc, 2 * g);
  CHECK(env->sim->counters().faults_injected == 1);
  CHECK(static_cast<char*>(live.blocks[2].first) == static_cast<char*>(live.blocks[1].first) + g);
  const memory_snapshot after = alloc.snapshot();
  REQUIRE(after.segments.size() == 2);  // the hole is still there, between the same runs
  CHECK(after.segments[0].address == before.segments[0].address);
  CHECK(after.segments[0].total_size == before.segments[0].total_size);
  CHECK(after.segments[1].address == before.segments[1].address);
  live.check(alloc);
  check_stats_match_snapshot(alloc.stats(), after);
  // The hole maps again when nothing fails.
  live.add(alloc, 2 * g);
  CHECK(live.blocks[3].first == middle);
  live.check(alloc);
  live.free_all(alloc);
}

TEST_CASE("a budget that stops a new expandable segment leaves no segment behind") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.expandable_segments = true;
  c.budget = 6 * MiB;
  device_allocator alloc(env->backend, c);
  live_set live;

  // Stream a: a free 4 MiB tail, cached.
  void* cached = alloc.allocate(4 * MiB);
  alloc.deallocate(cached);
  // Stream b needs 8 MiB: over the budget even after a's tail is released.
  const stream_ref b = env->new_stream();
  CHECK_THROWS_AS(alloc.allocate(8 * MiB, b), out_of_memory);
  const memory_snapshot snap = alloc.snapshot();
  const memory_stats st = alloc.stats();
  check_stats_match_snapshot(st, snap);
  CHECK(st.segment[0].current == static_cast<std::int64_t>(snap.segments.size()));
  CHECK(st.segment[0].current == 0);
  CHECK(st.reserved_bytes[0].current == 0);

  // With nothing cached, a refused first growth changes nothing at all.
  check_oom_changes_nothing(alloc, live, [&] { alloc.allocate(8 * MiB, b); });
  live.add(alloc, 6 * MiB, b);  // within the budget: works
  live.check(alloc);
  live.free_all(alloc);
}

TEST_CASE("a failed copy throws device_error, moves nothing, and leaves the allocator intact") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  const stream_ref s = env->new_stream();
  const std::size_t n = 64 * KiB;
  void* src = alloc.allocate(n, s);
  void* dst = alloc.allocate(n, s);
  std::memset(src, 0xAB, n);
  std::memset(dst, 0x11, n);
  const memory_stats before = alloc.stats();
  const memory_snapshot snap_before = alloc.snapshot();

  env->sim->fail_nth(fault_site::copy, 1);
  CHECK_THROWS_AS(env->backend->copy_async(dst, src, n, copy_kind::device_to_device, s), device_error);
  env->sim->run_until_idle();
  CHECK(static_cast<unsigned char*>(dst)[0] == 0x11);  // nothing was enqueued
  CHECK(static_cast<unsigned char*>(dst)[n - 1] == 0x11);
  check_same_stats(before, alloc.stats());
  check_same_snapshot(snap_before, alloc.snapshot());

  // The next copy works.
  env->backend->copy_async(dst, src, n, copy_kind::device_to_device, s);
  env->backend->synchronize_stream(s);
  CHECK(std::memcmp(dst, src, n) == 0);
  CHECK(alloc.deallocate(src) == free_status::freed);
  CHECK(alloc.deallocate(dst) == free_status::freed);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}
