// test_size_table: the size table (size_classes.hpp, Note [Size table]) walked exhaustively.
//
// It proves, for every request on each side of every 512-byte boundary up to 64 MiB and for a
// million random requests up to max_request_size: round_size is the smallest multiple of 512 that
// holds the request; the pool is small exactly for requests of at most 1 MiB; segment_size and
// min_segment_size follow the table (computed here independently, from the rounded size as PyTorch
// does) and are the smallest segments that serve the request; should_split splits exactly when
// the remainder is >= 512 B (small) or > 1 MiB (large). Then that the allocator really cuts blocks
// and reserves segments of those sizes, with and without a tight budget.
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;
namespace sc = spillway::size_classes;

// The table is usable at compile time.
static_assert(sc::round_size(1) == 512);
static_assert(sc::round_size(512) == 512);
static_assert(sc::round_size(513) == 1024);
static_assert(sc::is_small(sc::round_size(std::size_t{1} << 20)));
static_assert(!sc::is_small(sc::round_size((std::size_t{1} << 20) + 1)));
static_assert(sc::segment_size(512) == std::size_t{2} << 20);
static_assert(sc::should_split(1024, 512));
static_assert(!sc::should_split(std::size_t{21} << 20, std::size_t{20} << 20));

namespace {

// Independent statements of the table, written from the header's prose (not from its code).
std::size_t expected_round(std::size_t r) { return r % 512 == 0 ? r : r - r % 512 + 512; }
bool expected_small(std::size_t r) { return r <= MiB; }
std::size_t ceil_2mib(std::size_t n) { return n % (2 * MiB) == 0 ? n : n - n % (2 * MiB) + 2 * MiB; }
// The segment column looks at the rounded size, like PyTorch's get_allocation_size.
std::size_t expected_segment(std::size_t rounded) {
  if (rounded <= MiB) return 2 * MiB;
  if (rounded < 10 * MiB) return 20 * MiB;
  return ceil_2mib(rounded);
}
std::size_t expected_min_segment(std::size_t rounded) {
  return rounded <= MiB ? 2 * MiB : ceil_2mib(rounded);
}

// Counts checks and reports only failures: the walk makes millions of them.
struct walker {
  std::size_t checks = 0;
  std::size_t failures = 0;

  void expect(bool ok, std::size_t r, const char* what) {
    ++checks;
    if (!ok && ++failures <= 20) FAIL_CHECK("request " << r << ": " << what);
  }

  void check_request(std::size_t r) {
    const std::size_t rounded = sc::round_size(r);
    expect(rounded >= r, r, "round_size below the request");
    expect(rounded % 512 == 0, r, "round_size not a multiple of 512");
    expect(rounded - r < 512, r, "round_size not minimal");
    expect(rounded == expected_round(r), r, "round_size differs from the table");
    expect(sc::is_small(rounded) == expected_small(r), r, "wrong pool");

    const std::size_t seg = sc::segment_size(rounded);
    expect(seg == expected_segment(rounded), r, "segment_size differs from the table");
    expect(seg >= rounded, r, "segment_size cannot hold the request");
    expect(seg % (2 * MiB) == 0, r, "segment_size not a multiple of 2 MiB");

    const std::size_t min_seg = sc::min_segment_size(rounded);
    expect(min_seg == expected_min_segment(rounded), r, "min_segment_size differs from the table");
    expect(min_seg >= rounded && min_seg <= seg, r, "min_segment_size outside [rounded, segment]");
    // The smallest that serves it: small requests share 2 MiB segments; large ones get the
    // request rounded up to 2 MiB, no more.
    expect(sc::is_small(rounded) ? min_seg == sc::small_segment_size : min_seg - rounded < 2 * MiB,
           r, "min_segment_size not minimal");

    // The split rule at its threshold, for this rounded size.
    if (sc::is_small(rounded)) {
      expect(!sc::should_split(rounded, rounded), r, "split with nothing left");
      expect(!sc::should_split(rounded + 511, rounded), r, "small: split below 512 B");
      expect(sc::should_split(rounded + 512, rounded), r, "small: no split at 512 B");
      expect(sc::should_split(seg, rounded) == (seg - rounded >= 512), r, "small: fresh segment");
    } else {
      expect(!sc::should_split(rounded + MiB, rounded), r, "large: split at exactly 1 MiB");
      expect(sc::should_split(rounded + MiB + 1, rounded), r, "large: no split above 1 MiB");
      expect(sc::should_split(rounded + MiB + 512, rounded), r, "large: no split above 1 MiB");
      expect(sc::should_split(seg, rounded) == (seg - rounded > MiB), r, "large: fresh segment");
    }
  }
};

}  // namespace

TEST_CASE("every 512-byte boundary up to 64 MiB") {
  walker w;
  for (std::size_t b = 512; b <= 64 * MiB; b += 512) {
    w.check_request(b - 1);
    w.check_request(b);
    w.check_request(b + 1);
  }
  CHECK(w.failures == 0);
  CHECK(w.checks > 3 * 131072 * 10);
}

TEST_CASE("random requests up to max_request_size") {
  walker w;
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 350'000; ++i) {
      // Log-uniform, so that every magnitude from bytes to the maximum is covered.
      const int bits = 1 + static_cast<int>(rng() % 48);
      std::size_t r = 1 + rng() % (std::size_t{1} << bits);
      if (r > sc::max_request_size) r = sc::max_request_size;
      w.check_request(r);
    }
  }
  w.check_request(sc::max_request_size);
  w.check_request(sc::max_request_size - 1);
  CHECK(w.failures == 0);
  // The largest request rounds without overflow and still gets a segment that holds it.
  CHECK(sc::round_size(sc::max_request_size) == sc::max_request_size);
  CHECK(sc::segment_size(sc::max_request_size) == sc::max_request_size);
}

TEST_CASE("the table's boundaries, spelled out") {
  CHECK(sc::segment_size(sc::round_size(1 * MiB)) == 2 * MiB);
  CHECK(sc::segment_size(sc::round_size(1 * MiB + 1)) == 20 * MiB);
  CHECK(sc::segment_size(sc::round_size(10 * MiB - 513)) == 20 * MiB);  // rounds to 10 MiB - 512
  // A request just under 10 MiB rounds to 10 MiB, which gets a 10 MiB segment (PyTorch does the
  // same: its segment rule reads the rounded size).
  CHECK(sc::segment_size(sc::round_size(10 * MiB - 1)) == 10 * MiB);
  CHECK(sc::segment_size(sc::round_size(10 * MiB)) == 10 * MiB);
  CHECK(sc::segment_size(sc::round_size(10 * MiB + 1)) == 12 * MiB);
  CHECK(sc::min_segment_size(sc::round_size(3 * MiB)) == 4 * MiB);
  CHECK(sc::min_segment_size(sc::round_size(100)) == 2 * MiB);
}

TEST_CASE("the allocator cuts blocks and reserves segments by the table") {
  const std::size_t requests[] = {1,           511,          512,          513,
                                  4097,        MiB - 1,      MiB,          MiB + 1,
                                  2 * MiB,     5 * MiB + 3,  10 * MiB - 513, 10 * MiB - 1,
                                  10 * MiB,    10 * MiB + 1, 19 * MiB + 1, 19 * MiB - 1,
                                  64 * MiB + 7, 1024 * MiB + 1};
  auto env = make_sim_env();
  for (std::size_t r : requests) {
    const std::size_t rounded = sc::round_size(r);
    const std::size_t seg = sc::segment_size(rounded);
    INFO("request " << r);
    {
      device_allocator alloc(env->backend, env->config());
      void* p = alloc.allocate(r);
      const allocation_info info = alloc.describe(p);
      CHECK(info.requested_size == r);
      CHECK(info.segment_size == seg);
      CHECK(info.size == (sc::should_split(seg, rounded) ? rounded : seg));
      const memory_snapshot snap = alloc.snapshot();
      REQUIRE(snap.segments.size() == 1);
      CHECK(snap.segments[0].is_large == !sc::is_small(rounded));
      CHECK(snap.segments[0].blocks.size() == (sc::should_split(seg, rounded) ? 2u : 1u));
      // Served again from the cache: the same block, cut the same way.
      alloc.deallocate(p);
      CHECK(alloc.allocate(r) == p);
      CHECK(alloc.describe(p).size == info.size);
      alloc.deallocate(p);
    }
    {  // A budget of exactly the smallest segment: the allocator falls back to it.
      allocator_config c = env->config();
      c.budget = sc::min_segment_size(rounded);
      device_allocator alloc(env->backend, c);
      void* p = alloc.allocate(r);
      CHECK(alloc.describe(p).segment_size == sc::min_segment_size(rounded));
      const std::size_t min_seg = sc::min_segment_size(rounded);
      CHECK(alloc.describe(p).size == (sc::should_split(min_seg, rounded) ? rounded : min_seg));
      alloc.deallocate(p);
    }
  }
}

TEST_CASE("a cached block is split only when the remainder is worth keeping") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());

  // Large pool: a free 20 MiB block serving 19 MiB keeps the 1 MiB remainder inside the block.
  void* whole = alloc.allocate(5 * MiB);  // a 20 MiB segment
  alloc.deallocate(whole);
  void* p = alloc.allocate(19 * MiB);
  CHECK(p == whole);
  CHECK(alloc.describe(p).size == 20 * MiB);
  alloc.deallocate(p);
  p = alloc.allocate(19 * MiB - 512);  // remainder 1 MiB + 512: split
  CHECK(p == whole);
  CHECK(alloc.describe(p).size == 19 * MiB - 512);
  alloc.deallocate(p);

  // Small pool: a remainder of 512 B is kept as a block of its own, and serves the next request.
  void* a = alloc.allocate(MiB);        // half of a 2 MiB small segment
  void* b = alloc.allocate(MiB - 512);  // leaves exactly 512 B
  CHECK(alloc.describe(b).size == MiB - 512);
  const memory_snapshot snap = alloc.snapshot();
  const segment_info* seg = find_segment(snap, a);
  REQUIRE(seg != nullptr);
  REQUIRE(seg->blocks.size() == 3);
  CHECK(seg->blocks[2].size == 512);
  CHECK_FALSE(seg->blocks[2].active());
  void* c = alloc.allocate(1);
  CHECK(reinterpret_cast<std::uintptr_t>(c) == seg->blocks[2].address);
  for (void* x : {a, b, c}) alloc.deallocate(x);
}
