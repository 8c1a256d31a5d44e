// test_bad_input: every misuse gets a clear answer and changes nothing.
//
// It proves, for deallocate of an unknown, already freed, interior or null pointer; allocate of 0
// bytes and of sizes near SIZE_MAX; record_stream and describe of pointers that are not live;
// budgets of 0 or below live memory; empty pressure handlers; invalid device indices, mismatched
// or null backends: the call reports the case (a free_status and an on_warning message naming the
// pointer, or an exception naming the value and what was expected), and the statistics (field by
// field, except the counter of the failure itself) and the snapshot are identical before and after;
// live allocations keep their bytes.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/caching_allocator.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

std::string hex(const void* p) {
  char text[32];
  std::snprintf(text, sizeof text, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p)));
  return text;
}

// An allocator with a few live allocations (with patterns) and some cached memory.
struct populated {
  std::unique_ptr<backend_env> env = make_sim_env();
  device_allocator alloc{env->backend, env->config()};
  std::vector<std::pair<void*, std::size_t>> live;

  populated() {
    for (std::size_t n : {std::size_t{1000}, 300 * KiB, 3 * MiB, 12 * MiB}) {
      live.emplace_back(alloc.allocate(n), n);
      fill_pattern(live.back().first, n, live.size());
    }
    void* cached = alloc.allocate(5 * MiB, env->new_stream());
    alloc.deallocate(cached);
    void* freed = alloc.allocate(2000);
    alloc.deallocate(freed);
    env->warnings.clear();
  }
  ~populated() {
    for (auto [p, n] : live) alloc.deallocate(p);
  }

  // Runs `misuse` and checks that nothing but the counters in `counted` moved.
  template <class F>
  void expect_unchanged(F misuse, std::int64_t invalid_frees = 0, std::int64_t ooms = 0) {
    const memory_stats before = alloc.stats();
    const memory_snapshot snap = alloc.snapshot();
    misuse();
    const memory_stats after = alloc.stats();
    check_same_stats(before, after);
    check_same_snapshot(snap, alloc.snapshot());
    CHECK(after.num_invalid_frees == before.num_invalid_frees + invalid_frees);
    CHECK(after.num_ooms == before.num_ooms + ooms);
    CHECK(after.num_alloc_retries == before.num_alloc_retries + ooms);
    CHECK(after.num_sync_all_streams == before.num_sync_all_streams);
    for (std::size_t i = 0; i < live.size(); ++i) {
      CHECK(alloc.owns(live[i].first));
      CHECK(pattern_ok(live[i].first, live[i].second, i + 1));
    }
  }

  std::string only_warning() {
    const auto w = env->warnings.messages();
    REQUIRE(w.size() == 1);
    env->warnings.clear();
    return w[0];
  }
};

template <class E, class F>
std::string message_of(F call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return "";
}

}  // namespace

TEST_CASE("deallocate of pointers that are not live allocations") {
  populated p;
  int local = 0;

  SUBCASE("an unknown pointer") {
    p.expect_unchanged([&] { CHECK(p.alloc.deallocate(&local) == free_status::unknown_pointer); }, 1);
    const std::string w = p.only_warning();
    CHECK(contains(w, hex(&local)));
    CHECK(contains(w, "unknown pointer"));
  }
  SUBCASE("an already freed pointer") {
    void* q = p.alloc.allocate(4096);
    CHECK(p.alloc.deallocate(q) == free_status::freed);
    p.expect_unchanged([&] { CHECK(p.alloc.deallocate(q) == free_status::not_live); }, 1);
    const std::string w = p.only_warning();
    CHECK(contains(w, hex(q)));
    CHECK(contains(w, "not a live allocation"));
  }
  SUBCASE("an interior pointer of a live allocation") {
    void* inner = static_cast<char*>(p.live[1].first) + 512;
    p.expect_unchanged([&] { CHECK(p.alloc.deallocate(inner) == free_status::not_live); }, 1);
    CHECK(contains(p.only_warning(), hex(inner)));
  }
  SUBCASE("a pointer past the end of a segment") {
    const allocation_info info = p.alloc.describe(p.live[3].first);
    void* past = static_cast<char*>(info.segment_base) + info.segment_size + 64 * MiB;
    REQUIRE_FALSE(p.alloc.owns(past));  // whatever lies there, it is not a live allocation
    p.expect_unchanged([&] {
      const free_status st = p.alloc.deallocate(past);
      CHECK((st == free_status::unknown_pointer || st == free_status::not_live));
    }, 1);
    CHECK(contains(p.only_warning(), hex(past)));
  }
  SUBCASE("nullptr") {
    // Like cudaFree(nullptr): nothing to do, nothing counted, nothing reported.
    p.expect_unchanged([&] { CHECK(p.alloc.deallocate(nullptr) == free_status::null_pointer); }, 0);
    CHECK(p.env->warnings.messages().empty());
  }
  SUBCASE("a pointer whose free is pending on another stream") {
    const stream_ref other = p.env->new_stream();
    void* q = p.alloc.allocate(4096);
    p.alloc.record_stream(q, other);
    p.env->sim->hold(other);
    p.env->sim->launch(other, 1000);
    CHECK(p.alloc.deallocate(q) == free_status::deferred);
    p.expect_unchanged([&] { CHECK(p.alloc.deallocate(q) == free_status::not_live); }, 1);
    CHECK(contains(p.only_warning(), hex(q)));
    p.env->sim->release(other);
    p.env->sim->run_until_idle();
  }
}

TEST_CASE("allocate rejects 0 bytes and sizes beyond max_request_size") {
  populated p;
  const std::size_t sizes[] = {0, SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 511,
                               size_classes::max_request_size + 1};
  for (std::size_t n : sizes) {
    INFO("size " << n);
    p.expect_unchanged([&] {
      const std::string m = message_of<spillway::invalid_argument>([&] { p.alloc.allocate(n); });
      INFO(m);
      CHECK(contains(m, "allocate(" + std::to_string(n) + ")"));
      if (n == 0) {
        CHECK(contains(m, "at least 1 byte"));
      } else {
        CHECK(contains(m, format_bytes(size_classes::max_request_size)));
      }
    });
  }
  // The largest valid request is not invalid input: the device simply cannot hold it. (With the
  // cache empty, since running out of memory releases it.)
  p.alloc.empty_cache();
  p.expect_unchanged([&] {
    CHECK_THROWS_AS(p.alloc.allocate(size_classes::max_request_size), out_of_memory);
  }, /*invalid_frees=*/0, /*ooms=*/1);
}

TEST_CASE("record_stream and describe of pointers that are not live") {
  populated p;
  const stream_ref s = p.env->new_stream();
  int local = 0;
  void* freed = p.alloc.allocate(4096);
  p.alloc.deallocate(freed);
  void* inner = static_cast<char*>(p.live[0].first) + 512;

  for (void* bad : {static_cast<void*>(&local), freed, inner, static_cast<void*>(nullptr)}) {
    p.expect_unchanged([&] {
      const std::string m =
          message_of<spillway::invalid_argument>([&] { p.alloc.record_stream(bad, s); });
      INFO(m);
      CHECK(contains(m, "record_stream("));
      CHECK(contains(m, "stream " + std::to_string(s.value)));
      CHECK(contains(m, "not a live allocation"));
      CHECK_THROWS_AS(p.alloc.describe(bad), spillway::invalid_argument);
      CHECK_FALSE(p.alloc.owns(bad));
      CHECK(p.alloc.coalesced_size_if_freed(bad) == 0);
    });
  }
  // The live allocation was not marked: its free is immediate.
  void* q = p.live[0].first;
  p.live.erase(p.live.begin());
  CHECK(p.alloc.deallocate(q) == free_status::freed);
}

TEST_CASE("budgets of 0 and below live memory are refused") {
  populated p;
  const std::size_t allocated = static_cast<std::size_t>(p.alloc.stats().allocated_bytes[0].current);
  p.alloc.set_budget(1024 * MiB);

  p.expect_unchanged([&] {
    const std::string m = message_of<spillway::invalid_argument>([&] { p.alloc.set_budget(0); });
    CHECK(contains(m, "set_budget(0)"));
  });
  CHECK(p.alloc.budget() == 1024 * MiB);

  // Below live memory, with nothing cached to release: refused, and nothing changes at all.
  p.alloc.empty_cache();
  p.expect_unchanged([&] {
    const std::string m = message_of<spillway::invalid_argument>([&] { p.alloc.set_budget(allocated / 2); });
    INFO(m);
    CHECK(contains(m, format_bytes(allocated / 2)));
    CHECK(contains(m, format_bytes(allocated)));
    CHECK(contains(m, format_bytes(1024 * MiB)));
  });
  CHECK(p.alloc.budget() == 1024 * MiB);

  // A budget of 0 at construction.
  allocator_config c;
  c.budget = 0;
  CHECK_THROWS_AS(device_allocator(p.env->backend, c), spillway::invalid_argument);
  // scoped_budget: refused on construction, the budget unchanged.
  CHECK_THROWS_AS(scoped_budget(p.alloc, 1), spillway::invalid_argument);
  CHECK(p.alloc.budget() == 1024 * MiB);
}

TEST_CASE("an empty pressure handler is refused") {
  populated p;
  p.expect_unchanged([&] {
    CHECK_THROWS_AS(p.alloc.add_pressure_handler(pressure_handler{}), spillway::invalid_argument);
    p.alloc.remove_pressure_handler(12345);  // an unknown id is ignored
  });
}

TEST_CASE("a device_allocator needs a backend") {
  const std::string m = message_of<spillway::invalid_argument>(
      [] { device_allocator a(nullptr); });
  CHECK(contains(m, "nullptr"));
}

TEST_CASE("an expandable address range over the largest request is refused, naming it") {
  auto env = make_sim_env();
  for (const std::size_t range : {std::numeric_limits<std::size_t>::max(), size_classes::max_request_size + 1}) {
    CAPTURE(range);
    allocator_config c = env->expandable_config(unlimited_budget);
    c.expandable_address_range = range;  // rounded up to granules, the largest wrapped to 0
    const std::string m = message_of<spillway::invalid_argument>(
        [&] { device_allocator a(env->backend, c); });
    CHECK(contains(m, "expandable_address_range of " + std::to_string(range) + " bytes"));
    CHECK(contains(m, "expected at most 256.00 TiB"));
  }
  allocator_config c = env->expandable_config(unlimited_budget);
  c.expandable_address_range = size_classes::max_request_size;  // the largest is taken (whether
  device_allocator a(env->backend, c);                          // the host can reserve it is
  CHECK(a.config().expandable_address_range == size_classes::max_request_size);  // another matter)
}

TEST_CASE("caching_allocator: invalid device indices, mismatched and null backends") {
  auto make_sim = [](int index) {
    sim_config c = default_sim_config();
    c.device_index = index;
    return std::make_shared<sim_device>(c);
  };

  SUBCASE("device(-1) and device(n) name the index and the count") {
    warning_log warnings;
    allocator_config config;
    config.on_warning = warnings.sink();
    caching_allocator ca({make_sim(0), make_sim(1)}, config);
    CHECK(ca.device_count() == 2);
    for (int bad : {-1, 2, 1000}) {
      const std::string m = message_of<spillway::invalid_argument>([&] { ca.device(bad); });
      INFO(m);
      CHECK(contains(m, "invalid device " + std::to_string(bad)));
      CHECK(contains(m, "2 device(s)"));
      CHECK_THROWS_AS(ca.allocate(bad, 100), spillway::invalid_argument);
    }
    // Nothing was allocated by the failed calls.
    for (int d = 0; d < 2; ++d) CHECK(ca.device(d).stats().allocation[0].allocated == 0);

    // Routing: each pointer belongs to its device, and deallocate finds the owner.
    void* p0 = ca.allocate(0, 1000);
    void* p1 = ca.allocate(1, 1000);
    CHECK(ca.owner_of(p0) == &ca.device(0));
    CHECK(ca.owner_of(p1) == &ca.device(1));
    CHECK(ca.deallocate(p1) == free_status::freed);
    CHECK(ca.device(1).stats().allocation[0].current == 0);
    CHECK(ca.device(0).stats().allocation[0].current == 1);
    int local = 0;
    CHECK(ca.owner_of(&local) == nullptr);
    CHECK(ca.deallocate(&local) == free_status::unknown_pointer);
    REQUIRE(warnings.size() == 1);
    CHECK(contains(warnings.messages()[0], hex(&local)));
    CHECK(ca.deallocate(p0) == free_status::freed);
  }
  SUBCASE("backends out of device order") {
    const std::string m = message_of<spillway::invalid_argument>(
        [&] { caching_allocator ca({make_sim(0), make_sim(0)}); });
    INFO(m);
    CHECK(contains(m, "backend 1 reports device index 0, expected 1"));
  }
  SUBCASE("a null backend") {
    const std::string m = message_of<spillway::invalid_argument>(
        [&] { caching_allocator ca({make_sim(0), nullptr}); });
    CHECK(contains(m, "backend 1 is nullptr"));
  }
}
