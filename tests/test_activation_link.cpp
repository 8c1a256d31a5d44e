// test_activation_link: link_estimates and link_meter (torch_plugin/activation_link.hpp), what
// the activation managers weigh a spill by: each link's bandwidth as the bytes over the seconds
// of its recent copies, older ones decayed, per device and direction; the configured bandwidth
// until a link is measured (always, when fixed); the bytes occupying each device's copy engine,
// and the spill's time from them.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "activation_link.hpp"

using spillway::torch_plugin::link_direction;
using spillway::torch_plugin::link_estimates;
using spillway::torch_plugin::link_meter;

TEST_CASE("the configured bandwidth stands until a link has a sample") {
  link_estimates shared;
  link_meter m(2e9, /*fixed=*/false, shared);
  CHECK(m.bytes_per_s(0, link_direction::to_host) == 2e9);
  m.sample(0, link_direction::to_host, 1'000'000, 1e-3);
  CHECK(m.bytes_per_s(0, link_direction::to_host) == doctest::Approx(1e9));
  CHECK(m.bytes_per_s(0, link_direction::to_device) == 2e9);  // the other way: not measured
  CHECK(m.bytes_per_s(1, link_direction::to_host) == 2e9);    // another device's link
  CHECK(m.bytes_per_s(-1, link_direction::to_host) == 2e9);   // CPU storages' copies
}

TEST_CASE("the estimate is bytes over seconds, earlier copies decayed") {
  link_estimates shared;
  shared.sample(-1, link_direction::to_device, 1'000'000, 1e-3);
  shared.sample(-1, link_direction::to_device, 3'000'000, 1e-3);
  const double d = link_estimates::decay;
  CHECK(*shared.bytes_per_s(-1, link_direction::to_device) ==
        doctest::Approx((d * 1e6 + 3e6) / (d * 1e-3 + 1e-3)));
  // A link that became faster is followed: after 200 copies at 4 GB/s the first is forgotten.
  for (int i = 0; i < 200; ++i) shared.sample(-1, link_direction::to_device, 4'000'000, 1e-3);
  CHECK(*shared.bytes_per_s(-1, link_direction::to_device) == doctest::Approx(4e9).epsilon(1e-6));
}

TEST_CASE("a large copy weighs more than a small one, whose time is mostly latency") {
  link_estimates shared;
  shared.sample(0, link_direction::to_host, 64 << 20, 64e-3);  // 64 MiB at about 1 GB/s
  shared.sample(0, link_direction::to_host, 4096, 1e-5);       // 4 KiB in 10 us: 0.4 GB/s
  CHECK(*shared.bytes_per_s(0, link_direction::to_host) > 0.95 * (64 << 20) / 64e-3);
}

TEST_CASE("managers share what they measure; a fixed one keeps its bandwidth") {
  link_estimates shared;
  link_meter first(25e9, false, shared), later(25e9, false, shared), fixed(5e9, true, shared);
  first.sample(0, link_direction::to_host, 1'000'000, 1e-3);
  fixed.sample(0, link_direction::to_host, 1'000'000, 1e-3);  // its copies measure the link too
  CHECK(later.bytes_per_s(0, link_direction::to_host) == doctest::Approx(1e9));
  CHECK(fixed.bytes_per_s(0, link_direction::to_host) == 5e9);
  // The process's set is one object.
  CHECK(&link_estimates::process() == &link_estimates::process());
}

TEST_CASE("bad samples and devices out of range are ignored") {
  link_estimates shared;
  shared.sample(0, link_direction::to_host, 0, 1e-3);
  shared.sample(0, link_direction::to_host, 1000, -1.0);
  shared.sample(0, link_direction::to_host, 1000, std::numeric_limits<double>::quiet_NaN());
  shared.sample(0, link_direction::to_host, 1000, std::numeric_limits<double>::infinity());
  shared.sample(-2, link_direction::to_host, 1000, 1e-3);
  shared.sample(link_estimates::max_devices, link_direction::to_host, 1000, 1e-3);
  CHECK(!shared.bytes_per_s(0, link_direction::to_host).has_value());
  CHECK(!shared.bytes_per_s(-2, link_direction::to_host).has_value());
  CHECK(!shared.bytes_per_s(link_estimates::max_devices, link_direction::to_host).has_value());
  shared.sample(0, link_direction::to_host, 1000, 0.0);  // within the clock's resolution: finite
  REQUIRE(shared.bytes_per_s(0, link_direction::to_host).has_value());
  CHECK(std::isfinite(*shared.bytes_per_s(0, link_direction::to_host)));
}

TEST_CASE("copies occupying a device's copy engine delay a spill there, not elsewhere") {
  link_estimates shared;
  link_meter m(1e9, true, shared);
  m.reserve_device(1);
  CHECK(m.devices() == 2);
  m.set_occupied(1, 1'500'000);  // counted from the copies' events
  m.copy_queued(1, 500'000);     // queued since
  CHECK(m.occupied_bytes(1) == 2'000'000);
  CHECK(m.occupied_bytes(0) == 0);
  m.copy_queued(7, 1'000'000);  // never reserved: not counted (and nothing written)
  m.set_occupied(7, 1'000'000);
  CHECK(m.occupied_bytes(7) == 0);
  // Out: (occupied + bytes) / 1e9; back: bytes / 1e9.
  CHECK(m.spill_seconds(1'000'000, 1) == doctest::Approx(4e-3));
  CHECK(m.spill_seconds(1'000'000, 0) == doctest::Approx(2e-3));
  CHECK(m.spill_seconds(1'000'000, -1) == doctest::Approx(2e-3));  // a CPU storage
  m.set_occupied(1, 0);  // a later count: all complete
  CHECK(m.occupied_bytes(1) == 0);
}
