// test_allocator_conformance: the device_allocator contract, run against every device backend
// (backend_fixture.hpp: the sim device always, the CUDA backend when built and a device exists).
//
// It proves: allocations round trip, are 512-byte aligned and never overlap; a freed block is
// reused for the same stream and never for another; blocks split and coalesce so that the snapshot
// tiles every segment; requests land in the small or large pool per the size table; empty_cache
// gives every free segment back; the statistics and the snapshot report what happened, field by
// field; describe/owns/coalesced_size_if_freed/releasable_if_freed answer for live pointers (a
// segment counts as releasable once freeing empties it); the budget caps reserved
// bytes, out_of_memory explains itself, lowering the budget trims the cache, a budget below live
// memory is refused and scoped_budget restores. (Expandable segments: test_allocator_expandable.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;
namespace sc = spillway::size_classes;

namespace {

std::size_t block_size_of(const device_allocator& a, const void* p) { return a.describe(p).size; }

}  // namespace

TEST_CASE_TEMPLATE("allocate and deallocate round trip", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());

  void* p = alloc.allocate(1000);
  REQUIRE(p != nullptr);
  CHECK(alloc.owns(p));
  const allocation_info info = alloc.describe(p);
  CHECK(info.ptr == p);
  CHECK(info.size == 1024);
  CHECK(info.requested_size == 1000);
  CHECK(info.stream == stream_ref{});
  if (env.host_bytes()) {
    fill_pattern(p, 1000, 7);
    CHECK(pattern_ok(p, 1000, 7));
  }
  check_consistent(alloc);

  CHECK(alloc.deallocate(p) == free_status::freed);
  CHECK_FALSE(alloc.owns(p));
  const memory_stats st = alloc.stats();
  CHECK(st.allocation[0].current == 0);
  CHECK(st.allocated_bytes[0].current == 0);
  CHECK(st.num_invalid_frees == 0);
  check_consistent(alloc);
  CHECK(env.warnings.size() == 0);
}

TEST_CASE_TEMPLATE("every allocation is 512-byte aligned", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s = env.new_stream();

  const std::size_t sizes[] = {1,       7,           511,         512,         513,
                               4095,    1 * MiB - 1, 1 * MiB,     1 * MiB + 1, 3 * MiB + 3,
                               10 * MiB - 1, 10 * MiB, 10 * MiB + 1, 33 * MiB + 7};
  std::vector<void*> live;
  for (stream_ref stream : {stream_ref{}, s}) {
    for (std::size_t n : sizes) {
      void* p = alloc.allocate(n, stream);
      INFO("size " << n);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
      CHECK(block_size_of(alloc, p) >= sc::round_size(n));
      live.push_back(p);
    }
  }
  check_consistent(alloc);
  for (void* p : live) CHECK(alloc.deallocate(p) == free_status::freed);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("live allocations are distinct and never overlap", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref streams[] = {stream_ref{}, env.new_stream()};

  std::mt19937_64 rng(42);
  std::vector<std::pair<void*, std::size_t>> live;  // pointer, requested
  for (int i = 0; i < 300; ++i) {
    const std::size_t n = (rng() % 16 == 0) ? 1 + rng() % (16 * MiB) : 1 + rng() % (300 * KiB);
    void* p = alloc.allocate(n, streams[rng() % 2]);
    live.emplace_back(p, n);
    if (rng() % 4 == 0) {  // free a random one now and then, so that reuse happens too
      const std::size_t k = rng() % live.size();
      CHECK(alloc.deallocate(live[k].first) == free_status::freed);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  std::vector<std::pair<std::uintptr_t, std::size_t>> ranges;
  for (auto [p, n] : live) ranges.emplace_back(reinterpret_cast<std::uintptr_t>(p), block_size_of(alloc, p));
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    INFO("allocation " << i);
    CHECK(ranges[i - 1].first + ranges[i - 1].second <= ranges[i].first);
  }
  if (env.host_bytes()) {  // every byte of each allocation, so that any overlap shows
    for (std::size_t i = 0; i < live.size(); ++i) {
      std::memset(live[i].first, static_cast<int>(i % 251), live[i].second);
    }
    for (std::size_t i = 0; i < live.size(); ++i) {
      const auto* b = static_cast<const unsigned char*>(live[i].first);
      const bool intact = std::all_of(b, b + live[i].second,
                                      [&](unsigned char c) { return c == i % 251; });
      CHECK_MESSAGE(intact, "allocation " << i << " was overwritten by another");
    }
  }
  check_consistent(alloc);
  for (auto [p, n] : live) alloc.deallocate(p);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("a cache hit reuses the same block on the same stream", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());

  for (stream_ref s : {stream_ref{}, env.new_stream()}) {
    for (std::size_t n : {std::size_t{4000}, 700 * KiB, 5 * MiB, 12 * MiB}) {
      INFO("size " << n << " stream " << s.value);
      void* p = alloc.allocate(n, s);
      const std::int64_t device_allocs = alloc.stats().num_device_alloc;
      alloc.deallocate(p);
      CHECK(alloc.allocate(n, s) == p);  // the same size
      alloc.deallocate(p);
      CHECK(alloc.allocate(n - 100, s) == p);  // a smaller request that fits the cached block
      alloc.deallocate(p);
      CHECK(alloc.stats().num_device_alloc == device_allocs);  // served from the cache
    }
  }
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("different streams never share cached blocks", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s1 = env.new_stream();
  const stream_ref s2 = env.new_stream();

  for (std::size_t n : {std::size_t{64} * KiB, 4 * MiB}) {
    INFO("size " << n);
    void* a = alloc.allocate(n, s1);
    CHECK(alloc.deallocate(a) == free_status::freed);
    void* b = alloc.allocate(n, s2);
    CHECK(b != a);
    const memory_snapshot snap = alloc.snapshot();
    const segment_info* sa = find_segment(snap, a);
    const segment_info* sb = find_segment(snap, b);
    REQUIRE(sa != nullptr);
    REQUIRE(sb != nullptr);
    CHECK(sa != sb);
    CHECK(sa->stream == s1);
    CHECK(sb->stream == s2);
    void* c = alloc.allocate(n, s1);
    CHECK(c == a);  // s1's own block is still there
    alloc.deallocate(b);
    alloc.deallocate(c);
  }
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("blocks split and coalesce, tiling their segment", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());

  // Four 256 KiB blocks from one 2 MiB small segment, low addresses first.
  void* p[4];
  for (auto& x : p) x = alloc.allocate(256 * KiB);
  for (int i = 1; i < 4; ++i) {
    CHECK(reinterpret_cast<std::uintptr_t>(p[i]) ==
          reinterpret_cast<std::uintptr_t>(p[i - 1]) + 256 * KiB);
  }
  memory_snapshot snap = alloc.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].total_size == 2 * MiB);
  REQUIRE(snap.segments[0].blocks.size() == 5);  // four allocated + the free remainder
  CHECK(snap.segments[0].blocks[4].size == 1 * MiB);
  CHECK_FALSE(snap.segments[0].blocks[4].active());
  CHECK(alloc.stats().inactive_split[0].current == 1);
  CHECK(alloc.stats().inactive_split_bytes[0].current == static_cast<std::int64_t>(1 * MiB));
  check_consistent(alloc);

  // Free the second and the third: they coalesce into one 512 KiB free block.
  alloc.deallocate(p[1]);
  CHECK(alloc.coalesced_size_if_freed(p[2]) == 512 * KiB);
  alloc.deallocate(p[2]);
  snap = alloc.snapshot();
  REQUIRE(snap.segments[0].blocks.size() == 4);
  CHECK(snap.segments[0].blocks[1].size == 512 * KiB);
  CHECK_FALSE(snap.segments[0].blocks[1].active());
  CHECK(alloc.stats().inactive_split[0].current == 2);
  check_consistent(alloc);

  // The 512 KiB hole is the best fit for 300 KiB: the block splits again at its low end.
  void* q = alloc.allocate(300 * KiB);
  CHECK(q == p[1]);
  alloc.deallocate(q);

  // Freeing the first coalesces with the hole; freeing the last joins everything into one block.
  CHECK(alloc.coalesced_size_if_freed(p[3]) == 512 * KiB + 256 * KiB + 1 * MiB);
  alloc.deallocate(p[0]);
  alloc.deallocate(p[3]);
  snap = alloc.snapshot();
  REQUIRE(snap.segments.size() == 1);
  REQUIRE(snap.segments[0].blocks.size() == 1);
  CHECK(snap.segments[0].blocks[0].size == 2 * MiB);
  CHECK(alloc.stats().inactive_split[0].current == 0);
  CHECK(alloc.stats().inactive_split_bytes[0].current == 0);
  check_consistent(alloc);

  // Large pool: a 20 MiB segment splits while the remainder is over 1 MiB, and not below that.
  void* big = alloc.allocate(8 * MiB);
  void* rest = alloc.allocate(11 * MiB + 512 * KiB);  // 12 MiB free: remainder 512 KiB, no split
  CHECK(block_size_of(alloc, big) == 8 * MiB);
  CHECK(block_size_of(alloc, rest) == 12 * MiB);
  alloc.deallocate(big);
  alloc.deallocate(rest);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("small and large pools follow the size table", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);

  struct expectation {
    std::size_t request;
    bool large;
    std::size_t segment;
  };
  const expectation table[] = {
      {1, false, 2 * MiB},
      {1 * MiB, false, 2 * MiB},
      {1 * MiB + 1, true, 20 * MiB},
      {10 * MiB - 513, true, 20 * MiB},
      {10 * MiB - 1, true, 10 * MiB},  // rounds to 10 MiB (Note [Size table])
      {10 * MiB, true, 10 * MiB},
      {11 * MiB + 1, true, 12 * MiB},
  };
  for (const expectation& e : table) {
    INFO("request " << e.request);
    device_allocator fresh(env.backend, env.config());  // one segment per request
    void* p = fresh.allocate(e.request);
    const memory_snapshot snap = fresh.snapshot();
    REQUIRE(snap.segments.size() == 1);
    CHECK(snap.segments[0].is_large == e.large);
    CHECK(snap.segments[0].total_size == e.segment);
    CHECK(fresh.describe(p).segment_size == e.segment);
    const memory_stats st = fresh.stats();
    const int pool = e.large ? 2 : 1;
    const int other = e.large ? 1 : 2;
    CHECK(st.allocation[pool].current == 1);
    CHECK(st.allocation[other].current == 0);
    CHECK(st.reserved_bytes[pool].current == static_cast<std::int64_t>(e.segment));
    CHECK(st.reserved_bytes[other].current == 0);
    fresh.deallocate(p);
  }
}

TEST_CASE_TEMPLATE("empty_cache releases every free segment", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s = env.new_stream();

  void* keep = alloc.allocate(3 * MiB, s);  // its 20 MiB segment stays
  std::vector<void*> drop;
  for (std::size_t n : {std::size_t{1000}, 2 * MiB, 12 * MiB, 40 * MiB}) drop.push_back(alloc.allocate(n));
  drop.push_back(alloc.allocate(100, s));
  for (void* p : drop) alloc.deallocate(p);
  const std::int64_t reserved_before = alloc.stats().reserved_bytes[0].current;

  const std::size_t released = alloc.empty_cache();
  CHECK(released == static_cast<std::size_t>(reserved_before) - 20 * MiB);
  memory_snapshot snap = alloc.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].address == reinterpret_cast<std::uintptr_t>(alloc.describe(keep).segment_base));
  CHECK(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(20 * MiB));
  CHECK(alloc.stats().num_device_free == 4);
  check_consistent(alloc);

  alloc.deallocate(keep);
  CHECK(alloc.empty_cache() == 20 * MiB);
  const memory_stats st = alloc.stats();
  CHECK(st.reserved_bytes[0].current == 0);
  CHECK(st.segment[0].current == 0);
  CHECK(alloc.snapshot().segments.empty());
  CHECK(alloc.empty_cache() == 0);  // nothing left
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("on_segment_change tells of every segment reserved and released", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  struct change {
    segment_change what;
    void* address;
    std::size_t bytes;
    stream_ref stream;
  };
  std::vector<change> seen;
  allocator_config config = env.config();
  config.on_segment_change = [&](segment_change what, void* address, std::size_t bytes, stream_ref stream) {
    seen.push_back({what, address, bytes, stream});
  };
  device_allocator alloc(env.backend, config);
  const stream_ref s = env.new_stream();

  void* small = alloc.allocate(1000, s);  // a 2 MiB segment of the small pool, on s
  void* large = alloc.allocate(30 * MiB);  // a segment of its own size (rounded to 2 MiB)
  void* cached = alloc.allocate(3 * MiB);  // a 20 MiB segment
  REQUIRE(seen.size() == 3);
  for (const change& c : seen) {
    CHECK(c.what == segment_change::allocated);
    const allocation_info seg_of = alloc.describe(c.address);  // each segment's base is live
    CHECK(seg_of.segment_base == c.address);
    CHECK(seg_of.segment_size == c.bytes);
  }
  CHECK(seen[0].address == small);
  CHECK(seen[0].bytes == 2 * MiB);
  CHECK(seen[0].stream == s);
  CHECK(seen[1].address == large);
  CHECK(seen[2].bytes == 20 * MiB);
  CHECK(seen[2].stream == stream_ref{});
  // A cache hit reserves nothing.
  alloc.deallocate(cached);
  void* again = alloc.allocate(4 * MiB);
  CHECK(seen.size() == 3);

  // Released segments are told before the memory goes back, with the range they were reserved with.
  alloc.deallocate(large);
  alloc.deallocate(small);
  alloc.empty_cache();
  REQUIRE(seen.size() == 5);
  std::set<void*> freed;
  for (std::size_t i = 3; i < 5; ++i) {
    CHECK(seen[i].what == segment_change::freed);
    freed.insert(seen[i].address);
  }
  CHECK(freed == std::set<void*>{large, small});
  CHECK(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(20 * MiB));

  // What the observer throws is dropped: the allocator goes on, its counts right.
  config.on_segment_change = [](segment_change, void*, std::size_t, stream_ref) { throw std::runtime_error("no"); };
  device_allocator throwing(env.backend, config);
  void* p = throwing.allocate(3 * MiB);
  throwing.deallocate(p);
  CHECK(throwing.empty_cache() == 20 * MiB);
  CHECK(throwing.stats().reserved_bytes[0].current == 0);
  alloc.deallocate(again);
}

TEST_CASE_TEMPLATE("statistics count allocations, bytes, activity and splits", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const auto i64 = [](std::size_t n) { return static_cast<std::int64_t>(n); };

  memory_stats st = alloc.stats();
  CHECK(st.budget == -1);  // unlimited
  CHECK(st.max_split_size == -1);
  CHECK(st.allocation[0].current == 0);
  CHECK(st.reserved_bytes[0].peak == 0);

  void* a = alloc.allocate(1000);             // small: 1024 B of a 2 MiB segment
  void* b = alloc.allocate(3 * MiB + 1);      // large: 3 MiB + 512 of a 20 MiB segment
  const std::size_t b_size = 3 * MiB + 512;
  st = alloc.stats();
  CHECK(st.allocation[0].current == 2);
  CHECK(st.allocation[1].current == 1);
  CHECK(st.allocation[2].current == 1);
  CHECK(st.allocated_bytes[0].current == i64(1024 + b_size));
  CHECK(st.allocated_bytes[1].current == 1024);
  CHECK(st.allocated_bytes[2].current == i64(b_size));
  CHECK(st.requested_bytes[0].current == i64(1000 + 3 * MiB + 1));
  CHECK(st.requested_bytes[1].current == 1000);
  CHECK(st.reserved_bytes[0].current == i64(22 * MiB));
  CHECK(st.reserved_bytes[1].current == i64(2 * MiB));
  CHECK(st.segment[0].current == 2);
  CHECK(st.active[0].current == 2);
  CHECK(st.active_bytes[0].current == i64(1024 + b_size));
  CHECK(st.inactive_split[0].current == 2);  // both remainders
  CHECK(st.inactive_split_bytes[0].current == i64(2 * MiB - 1024 + 20 * MiB - b_size));
  CHECK(st.num_device_alloc == 2);
  check_consistent(alloc);

  alloc.deallocate(a);
  st = alloc.stats();
  CHECK(st.allocation[0].current == 1);
  CHECK(st.allocation[0].peak == 2);
  CHECK(st.allocation[0].allocated == 2);
  CHECK(st.allocation[0].freed == 1);
  CHECK(st.requested_bytes[0].current == i64(3 * MiB + 1));
  CHECK(st.requested_bytes[0].peak == i64(1000 + 3 * MiB + 1));
  CHECK(st.requested_bytes[0].allocated == i64(1000 + 3 * MiB + 1));
  CHECK(st.requested_bytes[0].freed == 1000);
  CHECK(st.requested_bytes[1].freed == 1000);
  CHECK(st.requested_bytes[2].freed == 0);
  CHECK(st.allocated_bytes[0].freed == 1024);
  CHECK(st.active[0].current == 1);
  CHECK(st.inactive_split[1].current == 0);  // the small segment is one free block again
  CHECK(st.inactive_split[2].current == 1);
  CHECK(st.reserved_bytes[0].current == i64(22 * MiB));  // cached, not released
  check_consistent(alloc);

  SUBCASE("reset_peak_stats sets every peak to its current value") {
    alloc.reset_peak_stats();
    st = alloc.stats();
    for (const named_stat_array& arr : all_stat_arrays) {
      for (int i = 0; i < stat_type_count; ++i) {
        INFO(std::string(arr.name) << " " << stat_type_name(i));
        CHECK((st.*arr.member)[i].peak == (st.*arr.member)[i].current);
      }
    }
    CHECK(st.allocation[0].allocated == 2);  // accumulated values are kept
    CHECK(st.requested_bytes[0].freed == 1000);
    void* c = alloc.allocate(512);
    alloc.deallocate(c);
    CHECK(alloc.stats().allocation[0].peak == 2);
  }
  SUBCASE("reset_accumulated_stats zeroes allocated/freed and the counters, keeps current") {
    alloc.reset_accumulated_stats();
    st = alloc.stats();
    for (const named_stat_array& arr : all_stat_arrays) {
      for (int i = 0; i < stat_type_count; ++i) {
        INFO(std::string(arr.name) << " " << stat_type_name(i));
        CHECK((st.*arr.member)[i].allocated == 0);
        CHECK((st.*arr.member)[i].freed == 0);
      }
    }
    CHECK(st.allocation[0].current == 1);
    CHECK(st.allocation[0].peak == 2);  // peaks are kept
    CHECK(st.requested_bytes[0].current == i64(3 * MiB + 1));
    CHECK(st.num_device_alloc == 0);
    CHECK(st.num_device_free == 0);
    CHECK(st.num_ooms == 0);
    CHECK(st.num_alloc_retries == 0);
    void* c = alloc.allocate(512);
    alloc.deallocate(c);
    CHECK(alloc.stats().allocation[0].allocated == 1);
    CHECK(alloc.stats().allocation[0].freed == 1);
    alloc.deallocate(b);
    check_consistent(alloc, /*accumulated_intact=*/false);
    b = nullptr;
  }
  if (b != nullptr) {
    alloc.deallocate(b);
    check_consistent(alloc);
  }
  CHECK(alloc.stats().allocated_bytes[0].current == 0);
}

TEST_CASE_TEMPLATE("inactive_split totals change once per allocation and per free, as PyTorch's", B,
                   SPILLWAY_ALL_BACKENDS) {
  // PyTorch applies the net change of each allocation and free, not every free-tree insert and
  // erase: cutting an inactive split block again only shrinks its bytes, and a free that merges
  // its neighbours counts them leaving once.
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const auto i64 = [](std::size_t n) { return static_cast<std::int64_t>(n); };
  void* a = alloc.allocate(512);  // a 2 MiB small segment: 512 B, and a remainder split off
  void* b = alloc.allocate(512);  // the remainder cut again
  memory_stats st = alloc.stats();
  CHECK(st.inactive_split[0].current == 1);
  CHECK(st.inactive_split[0].allocated == 1);
  CHECK(st.inactive_split[0].freed == 0);
  CHECK(st.inactive_split_bytes[0].current == i64(2 * MiB - 1024));
  CHECK(st.inactive_split_bytes[0].allocated == i64(2 * MiB - 512));
  CHECK(st.inactive_split_bytes[0].freed == 512);
  alloc.deallocate(a);  // a free split block, beside b
  alloc.deallocate(b);  // merges both neighbours: the segment is one free block again
  st = alloc.stats();
  CHECK(st.inactive_split[0].current == 0);
  CHECK(st.inactive_split[0].allocated == 2);
  CHECK(st.inactive_split[0].freed == 2);
  CHECK(st.inactive_split_bytes[0].current == 0);
  CHECK(st.inactive_split_bytes[0].allocated == i64(2 * MiB));
  CHECK(st.inactive_split_bytes[0].freed == i64(2 * MiB));
  CHECK(st.inactive_split[1].allocated == 2);  // the small pool's own
  CHECK(st.inactive_split[2].allocated == 0);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("the snapshot reports segments and blocks field by field", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s = env.new_stream();

  void* a = alloc.allocate(1000, s);
  void* b = alloc.allocate(5000, s);
  void* c = alloc.allocate(6 * MiB + 5);
  memory_snapshot snap = alloc.snapshot();
  REQUIRE(snap.segments.size() == 2);
  for (const segment_info& seg : snap.segments) {
    CHECK(seg.device == env.backend->device_index());
    CHECK_FALSE(seg.is_expandable);
  }
  const segment_info* small = find_segment(snap, a);
  const segment_info* large = find_segment(snap, c);
  REQUIRE(small != nullptr);
  REQUIRE(large != nullptr);
  CHECK(find_segment(snap, b) == small);
  CHECK_FALSE(small->is_large);
  CHECK(small->stream == s);
  CHECK(small->total_size == 2 * MiB);
  CHECK(small->allocated_size == 1024 + 5120);
  CHECK(small->requested_size == 1000 + 5000);
  CHECK(small->active_size == 1024 + 5120);
  REQUIRE(small->blocks.size() == 3);
  CHECK(small->blocks[0].address == reinterpret_cast<std::uintptr_t>(a));
  CHECK(small->blocks[0].size == 1024);
  CHECK(small->blocks[0].requested_size == 1000);
  CHECK(small->blocks[0].state == block_state::active_allocated);
  CHECK(small->blocks[1].requested_size == 5000);
  CHECK(small->blocks[2].state == block_state::inactive);
  CHECK(small->blocks[2].requested_size == 0);
  CHECK(large->is_large);
  CHECK(large->stream == stream_ref{});
  CHECK(large->total_size == 20 * MiB);
  CHECK(large->requested_size == 6 * MiB + 5);
  CHECK(large->allocated_size == 6 * MiB + 512);
  check_snapshot_invariants(snap);

  if (env.sim != nullptr) {  // a free that waits on another stream shows as active_pending_free
    const stream_ref other = env.new_stream();
    alloc.record_stream(b, other);
    env.sim->launch(other, 1'000'000);  // work on `other` that has not run yet
    CHECK(alloc.deallocate(b) == free_status::deferred);
    snap = alloc.snapshot();
    const block_info* pb = find_block(snap, b);
    REQUIRE(pb != nullptr);
    CHECK(pb->state == block_state::active_pending_free);
    CHECK_FALSE(pb->allocated());
    CHECK(pb->active());
    small = find_segment(snap, a);
    CHECK(small->allocated_size == 1024);
    CHECK(small->active_size == 1024 + 5120);
    check_stats_match_snapshot(alloc.stats(), snap);
    env.sim->run_until_idle();
    alloc.empty_cache();  // reaps the completed event
    const memory_snapshot reaped = alloc.snapshot();
    pb = find_block(reaped, b);
    CHECK((pb == nullptr || !pb->active()));
  } else {
    alloc.deallocate(b);
  }
  alloc.deallocate(a);
  alloc.deallocate(c);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("describe, owns and coalesced_size_if_freed", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s = env.new_stream();

  void* a = alloc.allocate(100 * KiB, s);
  void* b = alloc.allocate(200 * KiB, s);
  void* c = alloc.allocate(300 * KiB, s);
  const allocation_info ib = alloc.describe(b);
  CHECK(ib.ptr == b);
  CHECK(ib.size == 200 * KiB);
  CHECK(ib.requested_size == 200 * KiB);
  CHECK(ib.stream == s);
  CHECK(ib.segment_base == a);  // a is at the bottom of the segment
  CHECK(ib.segment_size == 2 * MiB);
  CHECK(alloc.owns(a));
  CHECK(alloc.owns(b));
  CHECK_FALSE(alloc.owns(static_cast<char*>(b) + 512));  // interior pointer
  CHECK_FALSE(alloc.owns(nullptr));

  // Nothing free around b; c has the free remainder above it.
  CHECK(alloc.coalesced_size_if_freed(b) == 200 * KiB);
  CHECK(alloc.coalesced_size_if_freed(c) == 2 * MiB - 100 * KiB - 200 * KiB);
  alloc.deallocate(a);
  CHECK(alloc.coalesced_size_if_freed(b) == 300 * KiB);
  CHECK(alloc.coalesced_size_if_freed(a) == 0);  // not live
  CHECK(alloc.coalesced_size_if_freed(static_cast<char*>(b) + 512) == 0);
  CHECK_THROWS_AS(alloc.describe(a), spillway::invalid_argument);
  CHECK_FALSE(alloc.owns(a));

  // A free that waits on another stream still counts: the range forms once its event completes.
  alloc.record_stream(b, env.new_stream());
  CHECK(alloc.coalesced_size_if_freed(b) == 300 * KiB);
  // Runs of free and pending-free neighbours chain: with b pending, c's range reaches down to a's.
  alloc.deallocate(b);
  CHECK(alloc.coalesced_size_if_freed(c) == 2 * MiB);
  alloc.deallocate(c);
  env.backend->synchronize_device();
  alloc.empty_cache();
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("releasable_if_freed: a fixed segment counts once freeing empties it", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  const stream_ref s = env.new_stream();

  void* a = alloc.allocate(100 * KiB, s);
  void* b = alloc.allocate(200 * KiB, s);
  CHECK(alloc.releasable_if_freed(a) == 0);  // b still lives in the 2 MiB segment
  CHECK(alloc.releasable_if_freed(b) == 0);
  void* big = alloc.allocate(2 * MiB, s);  // a large segment of its own
  CHECK(alloc.releasable_if_freed(big) == alloc.describe(big).segment_size);
  // A free pending on another stream counts as free, as in coalesced_size_if_freed.
  alloc.record_stream(a, env.new_stream());
  alloc.deallocate(a);
  CHECK(alloc.releasable_if_freed(b) == 2 * MiB);
  CHECK(alloc.releasable_if_freed(a) == 0);  // not live
  alloc.deallocate(b);
  alloc.deallocate(big);
  env.backend->synchronize_device();
  alloc.empty_cache();
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("the budget caps reserved bytes; out_of_memory explains", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  allocator_config config = env.config();
  config.budget = 30 * MiB;
  device_allocator alloc(env.backend, config);
  CHECK(alloc.budget() == 30 * MiB);
  CHECK(alloc.stats().budget == static_cast<std::int64_t>(30 * MiB));

  void* a = alloc.allocate(3 * MiB);   // a 20 MiB segment: 17 MiB free
  void* b = alloc.allocate(8 * MiB);   // from the same segment: 9 MiB free
  void* c = alloc.allocate(10 * MiB);  // a 10 MiB segment: reserved 30 MiB, the whole budget
  CHECK(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(30 * MiB));
  const memory_stats before = alloc.stats();
  const memory_snapshot snap_before = alloc.snapshot();

  const std::size_t request = 9 * MiB + 512 * KiB;  // needs a 10 MiB segment: over the budget
  bool thrown = false;
  try {
    alloc.allocate(request);
  } catch (const out_of_memory& e) {
    thrown = true;
    const std::string what = e.what();
    INFO(what);
    CHECK(contains(what, std::to_string(request)));
    CHECK(contains(what, format_bytes(request)));
    CHECK(contains(what, "budget " + format_bytes(30 * MiB)));
    CHECK(contains(what, format_bytes(21 * MiB) + " allocated"));
    CHECK(contains(what, format_bytes(30 * MiB) + " reserved"));
    CHECK(contains(what, "largest free block " + format_bytes(9 * MiB)));
    const out_of_memory::details& d = e.info();
    CHECK(d.device == env.backend->device_index());
    CHECK(d.requested == request);
    CHECK(d.rounded == request);
    CHECK(d.budget == 30 * MiB);
    CHECK(d.allocated == 21 * MiB);
    CHECK(d.reserved == 30 * MiB);
    CHECK(d.largest_free == 9 * MiB);
    CHECK(d.pinned == 0);
    if (env.sim != nullptr) CHECK(d.device_free == env.backend->free_memory());
  }
  CHECK(thrown);
  // Nothing changed, except the counters of the failure itself.
  const memory_stats after = alloc.stats();
  check_same_stats(before, after);
  check_same_snapshot(snap_before, alloc.snapshot());
  CHECK(after.num_ooms == before.num_ooms + 1);
  CHECK(alloc.owns(a));

  // Cache hits need no budget: 9 MiB fits the free remainder.
  void* d = alloc.allocate(9 * MiB);
  alloc.deallocate(d);
  // Freeing b makes 17 MiB contiguous: now the request fits without reserving.
  alloc.deallocate(b);
  void* e = alloc.allocate(request);
  CHECK(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(30 * MiB));
  alloc.deallocate(a);
  alloc.deallocate(c);
  alloc.deallocate(e);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("lowering the budget releases the cache and reports", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());

  void* big = alloc.allocate(12 * MiB);  // a 12 MiB segment
  void* a = alloc.allocate(3 * MiB);     // a 20 MiB segment
  alloc.deallocate(big);                 // 32 MiB reserved, 3 MiB allocated

  budget_report r = alloc.set_budget(24 * MiB);
  CHECK(r.budget == 24 * MiB);
  CHECK(r.released == 12 * MiB);
  CHECK(r.reserved == 20 * MiB);
  CHECK(r.shortfall == 0);
  CHECK(r.met());
  CHECK(alloc.budget() == 24 * MiB);
  CHECK(alloc.stats().budget == static_cast<std::int64_t>(24 * MiB));
  CHECK(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(20 * MiB));

  // Above the allocated bytes, below the reserved ones: applied, and the report says by how much.
  r = alloc.set_budget(4 * MiB);
  CHECK(r.budget == 4 * MiB);
  CHECK(r.released == 0);
  CHECK(r.reserved == 20 * MiB);
  CHECK(r.shortfall == 16 * MiB);
  CHECK_FALSE(r.met());
  CHECK(alloc.budget() == 4 * MiB);
  // The cache still serves; new memory is refused.
  void* from_cache = alloc.allocate(2 * MiB);
  CHECK(alloc.describe(from_cache).segment_base == alloc.describe(a).segment_base);
  // A small request, which would need a new small segment, takes the large segment's free block
  // instead (step 6 of Note [Memory pressure path]); what fits no cached block fails.
  void* borrowed = alloc.allocate(100);
  CHECK(alloc.describe(borrowed).segment_base == alloc.describe(a).segment_base);
  CHECK(alloc.stats().num_small_from_large == 1);
  alloc.deallocate(borrowed);
  CHECK_THROWS_AS(alloc.allocate(16 * MiB), out_of_memory);  // would need a new segment

  // Raising it back makes room again.
  r = alloc.set_budget(unlimited_budget);
  CHECK(r.met());
  CHECK(alloc.stats().budget == -1);
  void* small = alloc.allocate(100);
  alloc.deallocate(small);
  alloc.deallocate(from_cache);
  alloc.deallocate(a);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("a budget below live allocations is refused; the old one stays", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  alloc.set_budget(100 * MiB);
  void* live = alloc.allocate(12 * MiB);
  void* cached = alloc.allocate(2 * KiB);
  alloc.deallocate(cached);  // a free 2 MiB small segment

  bool thrown = false;
  try {
    alloc.set_budget(8 * MiB);
  } catch (const spillway::invalid_argument& e) {
    thrown = true;
    const std::string what = e.what();
    INFO(what);
    CHECK(contains(what, format_bytes(8 * MiB)));     // the budget asked for
    CHECK(contains(what, format_bytes(12 * MiB)));    // what live allocations hold
    CHECK(contains(what, format_bytes(100 * MiB)));   // the budget that stays
  }
  CHECK(thrown);
  CHECK(alloc.budget() == 100 * MiB);
  CHECK(alloc.stats().budget == static_cast<std::int64_t>(100 * MiB));
  // Without handlers the refusal comes first: the cached segment is still there.
  CHECK(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(12 * MiB + 2 * MiB));
  CHECK(alloc.owns(live));
  CHECK(alloc.describe(live).size == 12 * MiB);
  alloc.deallocate(live);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("below_live::accept sets a budget below live allocations; they fit again after frees", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());
  alloc.set_budget(100 * MiB);
  void* live = alloc.allocate(12 * MiB);
  void* cached = alloc.allocate(2 * KiB);
  alloc.deallocate(cached);  // a free 2 MiB small segment

  const budget_report r = alloc.set_budget(8 * MiB, below_live::accept);
  CHECK(alloc.budget() == 8 * MiB);
  CHECK(r.released == 2 * MiB);  // the cache above the budget went back
  CHECK(r.reserved == 12 * MiB);
  CHECK(r.shortfall == 4 * MiB);
  CHECK_FALSE(r.met());
  CHECK(alloc.owns(live));  // nothing live changed
  CHECK_THROWS_AS(alloc.allocate(1 * MiB), out_of_memory);  // a new segment is over the budget
  alloc.deallocate(live);
  alloc.empty_cache();
  void* fits = alloc.allocate(4 * MiB);  // under the budget again
  CHECK(fits != nullptr);
  alloc.deallocate(fits);
  CHECK_THROWS_AS(alloc.set_budget(0, below_live::accept), spillway::invalid_argument);
  CHECK(alloc.budget() == 8 * MiB);
  check_consistent(alloc);
}

TEST_CASE_TEMPLATE("scoped_budget sets a budget for its scope and restores the previous one", B, SPILLWAY_ALL_BACKENDS) {
  SPILLWAY_BACKEND_OR_SKIP(B, env);
  device_allocator alloc(env.backend, env.config());

  {
    scoped_budget outer(alloc, 64 * MiB);
    CHECK(outer.report().budget == 64 * MiB);
    CHECK(alloc.budget() == 64 * MiB);
    {
      scoped_budget inner(alloc, 16 * MiB);
      CHECK(alloc.budget() == 16 * MiB);
      CHECK_THROWS_AS(alloc.allocate(20 * MiB), out_of_memory);
    }
    CHECK(alloc.budget() == 64 * MiB);
    void* p = alloc.allocate(20 * MiB);
    alloc.deallocate(p);
  }
  CHECK(alloc.budget() == unlimited_budget);
  CHECK(alloc.stats().budget == -1);
  CHECK(env.warnings.size() == 0);

  // Construction throws what set_budget throws, and changes nothing.
  CHECK_THROWS_AS(scoped_budget(alloc, 0), spillway::invalid_argument);
  CHECK(alloc.budget() == unlimited_budget);

  // A restore that cannot be met is applied anyway and reported.
  alloc.set_budget(10 * MiB);
  void* small = alloc.allocate(4 * MiB);  // a 4 MiB segment: the 20 MiB one does not fit
  {
    scoped_budget wide(alloc, 64 * MiB);
    void* more = alloc.allocate(30 * MiB);
    (void)more;  // stays live past the restore
    env.warnings.clear();
  }
  CHECK(alloc.budget() == 10 * MiB);
  const auto warnings = env.warnings.messages();
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "restoring the budget"));
  CHECK(contains(warnings[0], format_bytes(10 * MiB)));
  alloc.deallocate(small);
  for (const block_info& b : all_blocks(alloc.snapshot())) {
    if (b.allocated()) alloc.deallocate(reinterpret_cast<void*>(b.address));
  }
  check_consistent(alloc);
}
