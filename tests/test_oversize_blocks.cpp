// test_oversize_blocks: allocator_config::max_split_size, PyTorch's max_split_size_mb
// (Note [Oversize blocks] in docs/design.md). A cached block of at least the limit is never split,
// serves no request below the limit, and serves a request at or above it only if it is less
// than 20 MiB larger; blocks below the limit split as before. Bad limits are refused, the limit is
// ignored (with a warning) on expandable segments, and the statistics count oversize blocks and
// segments as PyTorch's do.
#include <doctest/doctest.h>

#include <string>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

allocator_config with_limit(const backend_env& env, std::size_t limit) {
  allocator_config c = env.config();
  c.max_split_size = limit;
  return c;
}

}  // namespace

TEST_CASE("an oversize cached block is not split and keeps to requests of its class") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, with_limit(*env, 64 * MiB));
  CHECK(alloc.stats().max_split_size == static_cast<std::int64_t>(64 * MiB));

  void* big = alloc.allocate(100 * MiB);  // its own 100 MiB segment: oversize
  CHECK(alloc.stats().oversize_allocations.current == 1);
  CHECK(alloc.stats().oversize_segments.current == 1);
  alloc.deallocate(big);
  CHECK(alloc.stats().oversize_allocations.current == 0);

  // Below the limit: not from the oversize block (without the limit it would be cut from it).
  void* small = alloc.allocate(8 * MiB);
  CHECK(small != big);
  CHECK(alloc.describe(small).segment_size == 20 * MiB);
  void* mid = alloc.allocate(40 * MiB);   // under the limit too: a segment of its own
  CHECK(mid != big);

  // At or above the limit, less than 20 MiB smaller: served by the whole block, not split.
  void* near = alloc.allocate(90 * MiB);
  CHECK(near == big);
  CHECK(alloc.describe(near).size == 100 * MiB);
  CHECK(alloc.stats().oversize_allocations.current == 1);
  alloc.deallocate(near);

  // At or above the limit but 20 MiB or more smaller: a segment of its own.
  void* far = alloc.allocate(70 * MiB);
  CHECK(far != big);
  CHECK(alloc.describe(far).segment_size == 70 * MiB);
  CHECK(alloc.stats().oversize_segments.current == 2);

  // A block under the limit is split as before (30 MiB does not fit beside `small`).
  alloc.deallocate(mid);
  void* part = alloc.allocate(30 * MiB);
  CHECK(part == mid);
  CHECK(alloc.describe(part).size == 30 * MiB);

  for (void* p : {small, far, part}) alloc.deallocate(p);
  check_consistent(alloc);
  CHECK(alloc.empty_cache() > 0);
  CHECK(alloc.stats().oversize_segments.current == 0);
  CHECK(alloc.stats().oversize_segments.peak == 2);
}

TEST_CASE("a request just under the limit reuses the segment rounding made oversize") {
  // 63 MiB gets a 64 MiB segment: at the limit, so oversize. The same request must be served by
  // it again, not by a new segment every time (nor, under a budget, a release and a sync).
  auto env = make_sim_env();
  device_allocator alloc(env->backend, with_limit(*env, 64 * MiB));
  void* first = alloc.allocate(63 * MiB);
  CHECK(alloc.describe(first).segment_size == 64 * MiB);
  alloc.deallocate(first);
  for (int i = 0; i < 4; ++i) {
    void* again = alloc.allocate(63 * MiB);
    CHECK(again == first);
    alloc.deallocate(again);
  }
  CHECK(alloc.stats().num_device_alloc == 1);
  // Anything smaller still does not take it (the block is never split).
  void* smaller = alloc.allocate(61 * MiB);
  CHECK(smaller != first);
  alloc.deallocate(smaller);
  check_consistent(alloc);
}

TEST_CASE("under a budget an unusable oversize segment is given back for a small request") {
  auto env = make_sim_env();
  allocator_config c = with_limit(*env, 64 * MiB);
  c.budget = 105 * MiB;
  device_allocator alloc(env->backend, c);
  void* big = alloc.allocate(100 * MiB);
  alloc.deallocate(big);  // cached, but may not serve 8 MiB; 100 + 8 MiB is over the budget
  void* small = alloc.allocate(8 * MiB);
  CHECK(alloc.describe(small).size == 8 * MiB);
  CHECK(alloc.stats().oversize_segments.current == 0);  // released for it
  CHECK(alloc.stats().reserved_bytes[0].current <= static_cast<std::int64_t>(105 * MiB));
  alloc.deallocate(small);
  check_consistent(alloc);
}

TEST_CASE("a limit of 20 MiB or less is refused, naming the value and what was expected") {
  auto env = make_sim_env();
  for (std::size_t bad : {std::size_t{0}, std::size_t{1}, 20 * MiB}) {
    CAPTURE(bad);
    try {
      device_allocator alloc(env->backend, with_limit(*env, bad));
      FAIL("accepted max_split_size " << bad);
    } catch (const invalid_argument& e) {
      const std::string m = e.what();
      CHECK(m.find("max_split_size of " + std::to_string(bad) + " bytes") != std::string::npos);
      CHECK(m.find("expected more than 20.00 MiB") != std::string::npos);
    }
  }
  // Just over the limit is fine, and nothing was reserved by the refused ones.
  device_allocator ok(env->backend, with_limit(*env, 20 * MiB + 512));
  CHECK(ok.stats().reserved_bytes[0].current == 0);
}

TEST_CASE("with expandable segments the limit is ignored, with a warning") {
  auto env = make_sim_env();
  allocator_config c = with_limit(*env, 64 * MiB);
  c.expandable_segments = true;
  c.expandable_address_range = 1024 * MiB;
  device_allocator alloc(env->backend, c);
  const auto messages = env->warnings.messages();
  REQUIRE(messages.size() == 1);
  CHECK(messages[0].find("max_split_size ignored") != std::string::npos);
  CHECK(alloc.stats().max_split_size == -1);
  void* big = alloc.allocate(100 * MiB);
  alloc.deallocate(big);
  void* small = alloc.allocate(8 * MiB);  // split from the free range as without a limit
  CHECK(small == big);
  CHECK(alloc.stats().oversize_allocations.current == 0);
  alloc.deallocate(small);
}
