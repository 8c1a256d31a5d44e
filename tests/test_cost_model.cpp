// test_cost_model: spill or drop as cost_model.hpp describes, and the bandwidth probe.
//
// It proves: the spill cost is the restore time plus the wait for the spill's own copy behind the
// device-to-host bytes queued before it,
// so a busier copy engine makes spilling dearer; the drop cost is the recompute plus the evicted
// neighbourhood; automatic mode drops what is cheap to recompute and large, spills what is small
// and expensive to recompute, spills without lineage, drops without host memory, and does neither
// when neither is possible; the mode forces one or the other (or none when it is impossible);
// bandwidths that are not positive and finite throw; measure_bandwidth on a realtime sim_device
// returns positive finite figures and gives its memory back to the allocator; its probe shrinks to
// what the allocator's budget leaves, and with no room it is out_of_memory naming the budget; it
// throws device_error (no pinned memory, a failed copy) or out_of_memory (no device memory) when
// it cannot get its probe buffers, leaking nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/eviction/cost_model.hpp"
#include "spillway/sim_device.hpp"

using namespace spillway;
using namespace spillway::eviction;

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr std::size_t k_gib = std::size_t{1} << 30;
constexpr double k_pcie = 50e9;  // bytes per second each way, as the sim's default

const cost_model model({k_pcie, k_pcie});

eviction_action automatic(std::size_t bytes, double recompute_ns, bool can_spill = true,
                          bool can_drop = true, std::size_t queued = 0) {
  return model.choose(eviction_mode::automatic, bytes, queued, can_spill, can_drop, recompute_ns, 0);
}

}  // namespace

TEST_CASE("cost_model: the costs") {
  // 1 GiB out and back over 50 GB/s each way: ~21.5 ms for the pending allocation to get its
  // memory (the spill copy must finish first) and ~21.5 ms to restore it.
  CHECK(model.spill_cost_ns(k_gib, 0) == doctest::Approx(2 * k_gib / k_pcie * 1e9));
  CHECK(model.spill_cost_ns(0, 0) == 0);
  // Queued device-to-host copies go first: the memory comes back later by their time.
  CHECK(model.spill_cost_ns(k_mib, 100 * k_mib) > model.spill_cost_ns(k_mib, 0));
  CHECK(model.spill_cost_ns(k_mib, 100 * k_mib) ==
        doctest::Approx(model.spill_cost_ns(k_mib, 0) + 100 * k_mib / k_pcie * 1e9));
  CHECK(model.drop_cost_ns(1000, 250) == 1250);

  const cost_model asymmetric({10e9, 40e9});
  CHECK(asymmetric.spill_cost_ns(k_gib, 0) == doctest::Approx((k_gib / 10e9 + k_gib / 40e9) * 1e9));
  CHECK(asymmetric.spill_cost_ns(0, k_gib) == doctest::Approx(k_gib / 40e9 * 1e9));
  CHECK(asymmetric.bandwidth().h2d == 10e9);
  CHECK(asymmetric.bandwidth().d2h == 40e9);
}

TEST_CASE("cost_model: automatic mode across regimes") {
  // Cheap recompute (an activation, 50 us) of a large tensor (restore ~21 ms): drop.
  CHECK(automatic(k_gib, 50e3) == eviction_action::drop);
  // Expensive recompute (a 5 ms matmul) of a small tensor (restore ~21 us): spill.
  CHECK(automatic(k_mib, 5e6) == eviction_action::spill);
  // No lineage: spill, however expensive the restore.
  CHECK(automatic(k_gib, 1.0, true, false) == eviction_action::spill);
  // No host memory: drop, however expensive the recompute.
  CHECK(automatic(k_mib, 1e12, false, true) == eviction_action::drop);
  // Neither.
  CHECK(automatic(k_mib, 1.0, false, false) == eviction_action::none);
  // The evicted neighbourhood counts toward the drop cost (DTR's e*).
  const double restore = model.spill_cost_ns(64 * k_mib, 0);
  CHECK(model.choose(eviction_mode::automatic, 64 * k_mib, 0, true, true, restore / 2, 0) ==
        eviction_action::drop);
  CHECK(model.choose(eviction_mode::automatic, 64 * k_mib, 0, true, true, restore / 2, restore) ==
        eviction_action::spill);
  // A NaN recompute cost never wins against a spill.
  CHECK(automatic(k_gib, std::numeric_limits<double>::quiet_NaN()) == eviction_action::spill);
}

TEST_CASE("cost_model: a busy copy engine makes spilling dearer") {
  const std::size_t bytes = 64 * k_mib;
  const double restore = model.spill_cost_ns(bytes, 0);
  const double recompute = restore * 2;  // idle engine: spilling is cheaper
  CHECK(automatic(bytes, recompute, true, true, 0) == eviction_action::spill);
  // With 4 GiB already queued to the host, the wait behind them tips it to drop.
  CHECK(model.spill_cost_ns(bytes, 4 * k_gib) > recompute);
  CHECK(automatic(bytes, recompute, true, true, 4 * k_gib) == eviction_action::drop);
}

TEST_CASE("cost_model: the buffer's mode forces the action") {
  for (double recompute : {1.0, 1e12}) {
    CAPTURE(recompute);
    CHECK(model.choose(eviction_mode::spill, k_gib, 0, true, true, recompute, 0) == eviction_action::spill);
    CHECK(model.choose(eviction_mode::drop, k_gib, 0, true, true, recompute, 0) == eviction_action::drop);
    // A forced action that is impossible is none, never the other one.
    CHECK(model.choose(eviction_mode::spill, k_gib, 0, false, true, recompute, 0) == eviction_action::none);
    CHECK(model.choose(eviction_mode::drop, k_gib, 0, true, false, recompute, 0) == eviction_action::none);
  }
}

TEST_CASE("cost_model: bandwidths must be positive and finite") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (link_bandwidth bad : {link_bandwidth{0, 1e9}, link_bandwidth{1e9, 0}, link_bandwidth{-1, 1e9},
                             link_bandwidth{nan, 1e9}, link_bandwidth{1e9, inf}, link_bandwidth{}}) {
    std::string message;
    try {
      cost_model m(bad);
    } catch (const spillway::invalid_argument& e) {
      message = e.what();
    }
    CAPTURE(bad.h2d);
    CAPTURE(bad.d2h);
    CHECK(message.find("bandwidth") != std::string::npos);
  }
}

TEST_CASE("measure_bandwidth: positive finite figures on a realtime sim_device") {
  sim_config config;
  config.clock = clock_mode::realtime;
  config.capacity = 256 * k_mib;
  config.pinned_host_capacity = 256 * k_mib;
  auto sim = std::make_shared<sim_device>(config);
  device_allocator alloc(sim);
  const stream_ref s = sim->create_stream();

  const link_bandwidth measured = measure_bandwidth(alloc, s, 4 * k_mib);
  CAPTURE(measured.h2d);
  CAPTURE(measured.d2h);
  CHECK(std::isfinite(measured.h2d));
  CHECK(std::isfinite(measured.d2h));
  CHECK(measured.h2d > 0);
  CHECK(measured.d2h > 0);
  CHECK_NOTHROW(cost_model{measured});
  const sim_counters c = sim->counters();
  CHECK(alloc.stats().allocated_bytes[0].current == 0);  // the probe went back to the allocator
  CHECK(c.pinned_used_bytes == 0);
  CHECK(c.bytes_copied[static_cast<int>(copy_kind::host_to_device)] == 4 * 4 * k_mib);
  CHECK(c.bytes_copied[static_cast<int>(copy_kind::device_to_host)] == 4 * 4 * k_mib);
  alloc.empty_cache();
  sim->destroy_stream(s);
}

TEST_CASE("measure_bandwidth: the probe stays within the allocator's budget") {
  sim_config config;
  config.clock = clock_mode::realtime;
  config.capacity = 256 * k_mib;
  auto sim = std::make_shared<sim_device>(config);
  device_allocator alloc(sim);
  void* held = alloc.allocate(30 * k_mib);  // a 30 MiB segment

  // Headroom of 10, 11 and 3 MiB: the probe takes a whole number of 2 MiB (a segment for 11 or
  // 3 MiB would be 12 or 4 MiB, over the budget), and never goes over it.
  for (const std::size_t budget : {40 * k_mib, 41 * k_mib, 33 * k_mib}) {
    CAPTURE(budget);
    alloc.set_budget(budget);
    alloc.empty_cache();  // the last probe's segment
    alloc.reset_peak_stats();
    const std::size_t copied_before = sim->counters().bytes_copied[static_cast<int>(copy_kind::host_to_device)];
    const link_bandwidth measured = measure_bandwidth(alloc, stream_ref{}, 64 * k_mib);
    CHECK(measured.h2d > 0);
    const std::size_t probe =
        (sim->counters().bytes_copied[static_cast<int>(copy_kind::host_to_device)] - copied_before) / 4;
    CAPTURE(probe);
    CHECK(probe >= 2 * k_mib);
    CHECK(probe <= budget - 30 * k_mib);  // shrunk to what the budget left, not 64 MiB beside it
    CHECK(probe % (2 * k_mib) == 0);
    CHECK(alloc.stats().reserved_bytes[0].peak <= static_cast<std::int64_t>(budget));
    CHECK(alloc.stats().allocated_bytes[0].current == static_cast<std::int64_t>(30 * k_mib));
  }

  // The budget reserved in full, a third of it a cached free segment: the allocator gives that
  // back for the probe, so there is room for one.
  alloc.set_budget(unlimited_budget);
  alloc.empty_cache();  // the last probe's segment
  void* cached = alloc.allocate(10 * k_mib);
  alloc.deallocate(cached);
  alloc.set_budget(40 * k_mib);
  REQUIRE(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(40 * k_mib));
  CHECK(measure_bandwidth(alloc, sim->create_stream(), 64 * k_mib).d2h > 0);
  CHECK(alloc.stats().reserved_bytes[0].peak <= static_cast<std::int64_t>(40 * k_mib));
  alloc.empty_cache();

  // No room at all: out_of_memory naming the budget and what to do, and nothing changes.
  alloc.set_budget(30 * k_mib);
  try {
    (void)measure_bandwidth(alloc, stream_ref{}, 64 * k_mib);
    FAIL("measure_bandwidth did not throw");
  } catch (const spillway::out_of_memory& e) {
    const std::string what = e.what();
    CHECK(what.find("budget 30.00 MiB") != std::string::npos);
    CHECK(what.find("engine_config.bandwidth") != std::string::npos);
    CHECK(e.info().budget == 30 * k_mib);
  }
  CHECK(alloc.stats().allocated_bytes[0].current == static_cast<std::int64_t>(30 * k_mib));
  CHECK(sim->counters().pinned_used_bytes == 0);
  alloc.deallocate(held);
}

TEST_CASE("measure_bandwidth: no memory for the probe is an error, and nothing leaks") {
  sim_config config;
  config.capacity = 256 * k_mib;
  config.pinned_host_capacity = 256 * k_mib;
  auto sim = std::make_shared<sim_device>(config);
  device_allocator alloc(sim);

  sim->fail_nth(fault_site::pinned_host_allocation, 1);
  CHECK_THROWS_AS(measure_bandwidth(alloc, stream_ref{}, k_mib), spillway::device_error);
  sim->fail_nth(fault_site::segment_reservation, 1);
  CHECK_THROWS_AS(measure_bandwidth(alloc, stream_ref{}, k_mib), spillway::out_of_memory);
  CHECK(sim->counters().pinned_used_bytes == 0);
  CHECK(alloc.stats().allocated_bytes[0].current == 0);
  // A failing copy: the buffers still go back.
  sim->fail_nth(fault_site::copy, 2);
  CHECK_THROWS_AS(measure_bandwidth(alloc, stream_ref{}, k_mib), spillway::device_error);
  CHECK(sim->counters().pinned_used_bytes == 0);
  CHECK(alloc.stats().allocated_bytes[0].current == 0);
  CHECK_THROWS_AS(measure_bandwidth(alloc, stream_ref{}, 0), spillway::invalid_argument);
}
