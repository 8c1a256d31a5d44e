// test_plugin_runtime: plugin_allocator (torch_plugin/plugin_allocator.hpp), the allocator behind
// the C ABI and the preload shim, on simulated devices, and device_allocator::holds, which its
// routing of frees relies on.
//
// It proves: a device's allocator and backend are created on first use only, once, with the budget
// budget_for_device gives it (budget, budget_fraction of its own memory, device); bad device
// indices are invalid_argument naming the count; size 0 is nullptr; deallocate tells live
// allocations (freed, deferred behind another stream), double frees and pointers into the middle
// of a block (invalid, reported, nothing changes) and foreign memory (foreign, nothing reported)
// apart on every device; holds() covers whole segments, live or not, and nothing else;
// memory_info_of reports the budget as total and the budget's headroom plus the cache as free,
// bounded by the device; empty_cache releases every device's cache; concurrent first uses create
// one allocator.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "plugin_allocator.hpp"
#include "plugin_backends.hpp"
#include "spillway/errors.hpp"
#include "spillway/sim_device.hpp"

using namespace spillway;

namespace {

constexpr std::size_t M = std::size_t{1} << 20;

struct sim_devices {
  std::size_t capacity = 256 * M;
  std::vector<std::shared_ptr<sim_device>> made;
  std::atomic<int> calls{0};

  backend_factory factory() {
    return [this](int index) {
      ++calls;
      sim_config c;
      c.device_index = index;
      c.capacity = capacity;
      auto d = std::make_shared<sim_device>(c);
      made.push_back(d);
      return d;
    };
  }
};

struct warnings {
  std::vector<std::string> seen;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& m) { seen.push_back(m); };
  }
};

}  // namespace

TEST_CASE("devices are created on first use, once, each with its own budget") {
  sim_devices sims;
  plugin_allocator a(parse_config("budget:64MiB"), 3, sims.factory());
  CHECK(a.device_count() == 3);
  CHECK(sims.calls == 0);
  CHECK(a.created_device(0) == nullptr);
  void* p = a.allocate(1, 4 * M, {});
  REQUIRE(p != nullptr);
  CHECK(sims.calls == 1);
  CHECK(a.created_device(0) == nullptr);
  REQUIRE(a.created_device(1) != nullptr);
  CHECK(a.created_device(1)->device() == 1);
  CHECK(a.created_device(1)->budget() == 64 * M);
  CHECK(&a.device(1) == a.created_device(1));
  CHECK(sims.calls == 1);  // not again
  CHECK(a.deallocate(p) == free_result::freed);
}

TEST_CASE("budget_fraction is a fraction of each device's own memory; device scopes the budget") {
  sim_devices sims;
  sims.capacity = 200 * M;
  plugin_allocator frac(parse_config("budget_fraction:0.25"), 2, sims.factory());
  CHECK(frac.device(0).budget() == 50 * M);
  CHECK(frac.device(1).budget() == 50 * M);

  sim_devices sims2;
  plugin_allocator scoped(parse_config("budget:32MiB,device:1"), 2, sims2.factory());
  CHECK(scoped.device(0).budget() == unlimited_budget);
  CHECK(scoped.device(1).budget() == 32 * M);
}

TEST_CASE("bad device indices are invalid_argument naming the count; size 0 is nullptr") {
  sim_devices sims;
  plugin_allocator a(parse_config("backend:sim"), 1, sims.factory());
  for (int bad : {-1, 1, 7}) {
    CAPTURE(bad);
    try {
      a.allocate(bad, 1024, {});
      FAIL("no exception");
    } catch (const spillway::invalid_argument& e) {
      CHECK(std::string(e.what()).find("invalid device " + std::to_string(bad) + ": expected 0..0 (1 device(s) with backend sim)") != std::string::npos);
    }
  }
  CHECK(a.allocate(0, 0, {}) == nullptr);
  CHECK(a.device(0).stats().allocation[0].current == 0);
}

TEST_CASE("out of memory within the budget is out_of_memory, and nothing changes") {
  sim_devices sims;
  plugin_allocator a(parse_config("budget:64MiB"), 1, sims.factory());
  void* p = a.allocate(0, 40 * M, {});
  CHECK_THROWS_AS(a.allocate(0, 40 * M, {}), spillway::out_of_memory);
  CHECK(a.owner_of(p) == &a.device(0));
  CHECK(a.deallocate(p) == free_result::freed);
  void* q = a.allocate(0, 40 * M, {});  // fits again once p is back in the cache
  CHECK(a.deallocate(q) == free_result::freed);
}

TEST_CASE("deallocate routes live, double-freed, interior and foreign pointers apart") {
  sim_devices sims;
  warnings w;
  plugin_allocator a(parse_config(""), 2, sims.factory(), {.on_warning = w.sink()});
  void* p0 = a.allocate(0, 1 * M, {});
  void* p1 = a.allocate(1, 3 * M, {});
  CHECK(a.owner_of(p0) == &a.device(0));
  CHECK(a.owner_of(p1) == &a.device(1));
  CHECK(a.holder_of(p1) == &a.device(1));

  CHECK(a.deallocate(p1) == free_result::freed);
  CHECK(a.owner_of(p1) == nullptr);
  CHECK(a.holder_of(p1) == &a.device(1));  // still spillway's memory
  CHECK(w.seen.empty());

  CHECK(a.deallocate(p1) == free_result::invalid);  // double free: reported, counted, no change
  REQUIRE(w.seen.size() == 1);
  CHECK(w.seen[0].find("not a live allocation") != std::string::npos);
  CHECK(a.device(1).stats().num_invalid_frees == 1);

  void* interior = static_cast<char*>(p0) + 512;
  CHECK(a.deallocate(interior) == free_result::invalid);
  CHECK(a.owner_of(p0) == &a.device(0));  // p0 untouched

  int host = 0;
  void* heap = std::malloc(64);
  const std::size_t warned = w.seen.size();
  CHECK(a.deallocate(&host) == free_result::foreign);
  CHECK(a.deallocate(heap) == free_result::foreign);
  CHECK(a.deallocate(nullptr) == free_result::foreign);
  CHECK(w.seen.size() == warned);  // foreign memory is the caller's business: nothing reported
  std::free(heap);
  CHECK(a.deallocate(p0) == free_result::freed);
}

TEST_CASE("a free of memory another stream used waits for that stream") {
  sim_devices sims;
  plugin_allocator a(parse_config("backend:sim"), 1, sims.factory());
  device_allocator& d = a.device(0);
  sim_device& sim = *sims.made.at(0);
  const stream_ref other = sim.create_stream();
  void* p = a.allocate(0, 1 * M, {});
  d.record_stream(p, other);
  sim.launch(other, 1'000'000);  // work on `other` that may still read p
  sim.hold(other);
  CHECK(a.deallocate(p) == free_result::deferred);
  CHECK(a.owner_of(p) == nullptr);
  CHECK(a.holder_of(p) == &d);
  sim.release(other);
  sim.run_until_idle();
  sim.destroy_stream(other);
}

TEST_CASE("holds covers whole segments, live or free, and nothing else") {
  sim_config c;
  c.capacity = 256 * M;
  auto sim = std::make_shared<sim_device>(c);
  device_allocator d(sim);
  void* p = d.allocate(1 * M);  // a 20 MiB large-pool segment
  const allocation_info info = d.describe(p);
  CHECK(d.holds(p));
  CHECK(d.holds(static_cast<char*>(info.segment_base) + info.segment_size - 1));
  CHECK(!d.holds(static_cast<char*>(info.segment_base) + info.segment_size));
  CHECK(!d.holds(static_cast<char*>(info.segment_base) - 1));
  CHECK(!d.holds(nullptr));
  d.deallocate(p);
  CHECK(d.holds(p));  // cached: still spillway's
  d.empty_cache();
  CHECK(!d.holds(p));  // released to the device
}

TEST_CASE("holds covers the whole address range of an expandable segment") {
  sim_config c;
  c.capacity = 256 * M;
  auto sim = std::make_shared<sim_device>(c);
  allocator_config ac;
  ac.expandable_segments = true;
  ac.expandable_address_range = 64 * M;
  device_allocator d(sim, ac);
  void* p = d.allocate(2 * M);
  const allocation_info info = d.describe(p);
  CHECK(d.holds(static_cast<char*>(info.segment_base) + 64 * M - 1));  // reserved, not yet mapped
  CHECK(!d.holds(static_cast<char*>(info.segment_base) + 64 * M));
  d.deallocate(p);
}

TEST_CASE("memory_info_of: the budget is the total; free is its headroom plus the cache") {
  sim_devices sims;
  plugin_allocator a(parse_config("budget:64MiB"), 1, sims.factory());
  memory_info m = a.memory_info_of(0);
  CHECK(m.total == 64 * M);
  CHECK(m.free == 64 * M);

  void* p = a.allocate(0, 30 * M, {});  // reserves a 30 MiB segment (rounded to 2 MiB)
  const memory_stats s = a.device(0).stats();
  const auto reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
  const auto allocated = static_cast<std::size_t>(s.allocated_bytes[0].current);
  m = a.memory_info_of(0);
  CHECK(m.total == 64 * M);
  CHECK(m.free == 64 * M - reserved + (reserved - allocated));
  CHECK(m.free == 64 * M - allocated);

  a.deallocate(p);  // cached, not released: it is still free to the program
  m = a.memory_info_of(0);
  CHECK(m.free == 64 * M);
}

TEST_CASE("memory_info_of is bounded by the device") {
  sim_devices sims;
  sims.capacity = 100 * M;
  SUBCASE("no budget: the device's total and free") {
    plugin_allocator a(parse_config(""), 1, sims.factory());
    void* p = a.allocate(0, 30 * M, {});
    const memory_info m = a.memory_info_of(0);
    CHECK(m.total == 100 * M);
    const std::size_t device_free = sims.made[0]->free_memory();
    const auto allocated = static_cast<std::size_t>(a.device(0).stats().allocated_bytes[0].current);
    const auto reserved = static_cast<std::size_t>(a.device(0).stats().reserved_bytes[0].current);
    CHECK(m.free == device_free + reserved - allocated);
    a.deallocate(p);
  }
  SUBCASE("a budget above the device: the device's memory, and what others took is not free") {
    plugin_allocator a(parse_config("budget:1GiB"), 1, sims.factory());
    a.device(0);
    void* other = sims.made[0]->reserve_segment(60 * M);  // another user of the device
    const memory_info m = a.memory_info_of(0);
    CHECK(m.total == 100 * M);
    CHECK(m.free == 40 * M);
    sims.made[0]->release_segment(other, 60 * M);
  }
}

TEST_CASE("empty_cache releases the cache of every created device") {
  sim_devices sims;
  plugin_allocator a(parse_config(""), 2, sims.factory());
  a.deallocate(a.allocate(0, 4 * M, {}));
  a.deallocate(a.allocate(1, 4 * M, {}));
  CHECK(a.device(0).stats().reserved_bytes[0].current > 0);
  CHECK(a.empty_cache() > 0);
  CHECK(a.device(0).stats().reserved_bytes[0].current == 0);
  CHECK(a.device(1).stats().reserved_bytes[0].current == 0);
}

TEST_CASE("concurrent first uses of a device create one allocator") {
  sim_devices sims;
  plugin_allocator a(parse_config(""), 1, sims.factory());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        void* p = a.allocate(0, 4096, {});
        if (a.deallocate(p) != free_result::freed) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(sims.calls == 1);
  CHECK(failures == 0);
}

TEST_CASE("make_backends: sim is one device of sim_capacity") {
  const backend_set b = make_backends(parse_config("backend:sim,sim_capacity:1GiB"));
  CHECK(b.device_count == 1);
  const auto dev = b.make(0);
  CHECK(dev->device_index() == 0);
  CHECK(dev->total_memory() == std::size_t{1} << 30);
}

TEST_CASE("a bad backend, device count or factory is invalid_argument naming it") {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const spillway::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  plugin_config rocm = parse_config("backend:sim");
  rocm.backend = "rocm";  // parse_config refuses it; a config built in C++ may not
  CHECK(message([&] { make_backends(rocm); }) ==
        "spillway: unknown backend \"rocm\": expected cuda or sim");
  CHECK(message([&] { make_plugin_allocator(rocm, {}); }).find("\"rocm\"") != std::string::npos);
  sim_devices sims;
  CHECK(message([&] { plugin_allocator(parse_config("backend:sim"), -2, sims.factory()); }) ==
        "spillway: plugin_allocator: device count -2 is invalid: expected >= 0");
  CHECK(message([&] { plugin_allocator(parse_config("backend:sim"), 1, backend_factory{}); })
            .find("the backend factory is empty") != std::string::npos);
  // A budget for a device that is not there would apply to none.
  CHECK(message([&] { plugin_allocator(parse_config("backend:sim,budget:1GiB,device:3"), 2, sims.factory()); }) ==
        "spillway: SPILLWAY_CONF device:3 names no device: expected 0..1 (2 device(s) visible with backend sim)");
  CHECK_NOTHROW(plugin_allocator(parse_config("backend:sim,budget:1GiB,device:1"), 2, sims.factory()));
  CHECK(sims.calls == 0);
}

TEST_CASE("stream_of: on CUDA cudaStreamLegacy (0x1) is the default stream; elsewhere handles pass through") {
  sim_devices sims;
  // Only the backend's name matters to stream_of; the devices stay simulated.
  plugin_allocator on_cuda(parse_config("backend:cuda"), 1, sims.factory());
  CHECK(on_cuda.stream_of(nullptr).value == 0);
  CHECK(on_cuda.stream_of(reinterpret_cast<const void*>(std::uintptr_t{1})).value == 0);
  CHECK(on_cuda.stream_of(reinterpret_cast<const void*>(std::uintptr_t{0x7f00})).value == 0x7f00);
  plugin_allocator on_sim(parse_config("backend:sim"), 1, sims.factory());
  CHECK(on_sim.stream_of(reinterpret_cast<const void*>(std::uintptr_t{1})).value == 1);  // a sim stream
}
