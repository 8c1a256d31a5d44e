// test_allocator_compaction: the allocator's side of Note [Compaction], on every backend.
//
// It proves: partly_free_segments lists exactly the fixed segments with live and free blocks
// (not a full one, not a wholly free one, not one with a free pending on another stream), with
// their live bytes; for_each_live_allocation visits a segment's live blocks in address order,
// stops when told, and visits nothing for an address that is no segment's base; allocate_cached takes the best-fitting hole
// outside the named segment, never a wholly free segment, never reserves memory nor calls a
// pressure handler, returns nullptr when no hole fits, and rejects sizes as allocate does;
// cached_free_bytes is reserved minus allocated; with expandable segments nothing is listed.
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// Two 20 MiB segments of five 4 MiB blocks each on stream s, then holes punched: A keeps its
// blocks 2 and 3 (8-16 MiB), B keeps block 1 (4-8 MiB).
struct two_segments {
  device_allocator& alloc;
  stream_ref s;
  std::vector<void*> a, b;
  int handler_calls = 0;

  two_segments(device_allocator& al, stream_ref st) : alloc(al), s(st) {
    for (int i = 0; i < 5; ++i) a.push_back(alloc.allocate(4 * MiB, s));
    for (int i = 0; i < 5; ++i) b.push_back(alloc.allocate(4 * MiB, s));
    for (int i : {0, 1, 4}) alloc.deallocate(a[static_cast<std::size_t>(i)]);
    for (int i : {0, 2, 3, 4}) alloc.deallocate(b[static_cast<std::size_t>(i)]);
    alloc.add_pressure_handler([this](const pressure_request&) {
      ++handler_calls;
      return pressure_result{0, 0};
    });
  }
  void* base_a() const { return alloc.describe(a[2]).segment_base; }
  void* base_b() const { return alloc.describe(b[1]).segment_base; }
};

}  // namespace

TEST_CASE_TEMPLATE("partly_free_segments and for_each_live_allocation describe what compaction may empty",
                   B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s = env.new_stream();
  two_segments t(alloc, s);
  void* full = alloc.allocate(20 * MiB, s);  // a segment of its own, no free block
  void* gone = alloc.allocate(30 * MiB, s);  // a segment that becomes wholly free
  alloc.deallocate(gone);

  std::vector<segment_usage> u = alloc.partly_free_segments();
  std::sort(u.begin(), u.end(), [](const segment_usage& x, const segment_usage& y) {
    return x.allocated_bytes < y.allocated_bytes;
  });
  REQUIRE(u.size() == 2);
  CHECK(u[0].base == t.base_b());
  CHECK(u[0].allocated_bytes == 4 * MiB);
  CHECK(u[0].live_blocks == 1);
  CHECK(u[1].base == t.base_a());
  CHECK(u[1].allocated_bytes == 8 * MiB);
  CHECK(u[1].live_blocks == 2);
  for (const segment_usage& x : u) {
    CHECK(x.size == 20 * MiB);
    CHECK(x.stream == s);
    CHECK_FALSE(x.small);
  }
  const auto live_in = [&](const void* base, std::size_t stop_after) {
    std::vector<void*> seen;
    const bool all = alloc.for_each_live_allocation(base, [&](void* p) {
      seen.push_back(p);
      return seen.size() < stop_after;
    });
    return std::pair{all, seen};
  };
  CHECK(live_in(t.base_a(), 9) == std::pair{true, std::vector<void*>{t.a[2], t.a[3]}});
  CHECK(live_in(t.base_a(), 1) == std::pair{false, std::vector<void*>{t.a[2]}});
  CHECK(live_in(t.base_b(), 9) == std::pair{true, std::vector<void*>{t.b[1]}});
  CHECK(live_in(t.a[3], 9) == std::pair{false, std::vector<void*>{}});  // inside A, not its base
  CHECK(live_in(nullptr, 9) == std::pair{false, std::vector<void*>{}});

  // A free that waits on another stream keeps its segment off the list until it completes.
  const stream_ref other = env.new_stream();
  alloc.record_stream(t.a[3], other);
  CHECK(alloc.deallocate(t.a[3]) == free_status::deferred);
  u = alloc.partly_free_segments();
  CHECK(std::none_of(u.begin(), u.end(), [&](const segment_usage& x) { return x.base == t.base_a(); }));
  env.backend->synchronize_device();
  alloc.deallocate(full);
  alloc.deallocate(t.a[2]);
  alloc.deallocate(t.b[1]);
}

TEST_CASE_TEMPLATE("allocate_cached fills holes outside a segment and never reserves",
                   B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  allocator_config c = env.config();
  c.budget = 64 * MiB;
  device_allocator alloc(env.backend, c);
  const stream_ref s = env.new_stream();
  two_segments t(alloc, s);
  void* gone = alloc.allocate(20 * MiB, s);  // a third segment, wholly free afterwards
  alloc.deallocate(gone);
  const memory_stats before = alloc.stats();
  CHECK(alloc.cached_free_bytes() ==
        static_cast<std::size_t>(before.reserved_bytes[0].current - before.allocated_bytes[0].current));
  CHECK(alloc.cached_free_bytes() == 60 * MiB - 12 * MiB);

  // Outside B: A's holes are 0-8 and 16-20 MiB; best fit for 4 MiB is 16-20.
  void* p = alloc.allocate_cached(4 * MiB, s, t.base_b());
  REQUIRE(p != nullptr);
  CHECK(alloc.describe(p).segment_base == t.base_a());
  CHECK(static_cast<char*>(p) == static_cast<char*>(t.base_a()) + 16 * MiB);
  // Outside A: B's hole 8-20 (12 MiB) takes 8; the wholly free third segment is never used.
  void* q = alloc.allocate_cached(8 * MiB, s, t.base_a());
  REQUIRE(q != nullptr);
  CHECK(alloc.describe(q).segment_base == t.base_b());
  // 16 MiB: only the wholly free segment could hold it: nullptr.
  CHECK(alloc.allocate_cached(16 * MiB, s, nullptr) == nullptr);
  // Another stream's pool has no holes at all.
  CHECK(alloc.allocate_cached(MiB, env.new_stream(), nullptr) == nullptr);
  const memory_stats after = alloc.stats();
  CHECK(after.reserved_bytes[0].current == before.reserved_bytes[0].current);
  CHECK(after.num_device_alloc == before.num_device_alloc);
  CHECK(t.handler_calls == 0);
  CHECK_THROWS_AS((void)alloc.allocate_cached(0, s, nullptr), invalid_argument);
  CHECK_THROWS_WITH_AS((void)alloc.allocate_cached(size_classes::max_request_size + 1, s, nullptr),
                       doctest::Contains("exceeds the largest request"), invalid_argument);
  const memory_snapshot snap = alloc.snapshot();
  check_snapshot_invariants(snap);
  check_stats_match_snapshot(alloc.stats(), snap);
  for (void* x : {p, q, t.a[2], t.a[3], t.b[1]}) alloc.deallocate(x);
}

TEST_CASE("expandable segments: nothing to compact") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.expandable_segments = true;
  device_allocator alloc(env->backend, c);
  void* x = alloc.allocate(4 * MiB);
  void* y = alloc.allocate(4 * MiB);
  alloc.deallocate(x);
  CHECK(alloc.partly_free_segments().empty());
  alloc.deallocate(y);
}
