// test_activation_link: link_meter (torch_plugin/activation_link.hpp), what the activation
// manager weighs a spill by: the configured bandwidth until a direction is measured (always, when
// fixed), the bytes over the seconds of recent copies with older ones decayed, the copies queued
// on each device's copy engine, and the spill's time from them.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "activation_link.hpp"

using spillway::torch_plugin::link_direction;
using spillway::torch_plugin::link_meter;

TEST_CASE("the configured bandwidth stands until a direction has a sample") {
  link_meter m(2e9, /*fixed=*/false);
  CHECK(m.bytes_per_s(link_direction::to_host) == 2e9);
  CHECK(m.bytes_per_s(link_direction::to_device) == 2e9);
  m.sample(link_direction::to_host, 1'000'000, 1e-3);
  CHECK(m.bytes_per_s(link_direction::to_host) == doctest::Approx(1e9));
  CHECK(m.bytes_per_s(link_direction::to_device) == 2e9);  // the other way is not measured yet
}

TEST_CASE("the estimate is bytes over seconds, earlier copies decayed") {
  link_meter m(1e9, false);
  m.sample(link_direction::to_device, 1'000'000, 1e-3);
  m.sample(link_direction::to_device, 3'000'000, 1e-3);
  const double d = link_meter::decay;
  CHECK(m.bytes_per_s(link_direction::to_device) ==
        doctest::Approx((d * 1e6 + 3e6) / (d * 1e-3 + 1e-3)));
  // A link that became faster is followed: after 200 copies at 4 GB/s the first is forgotten.
  for (int i = 0; i < 200; ++i) m.sample(link_direction::to_device, 4'000'000, 1e-3);
  CHECK(m.bytes_per_s(link_direction::to_device) == doctest::Approx(4e9).epsilon(1e-6));
}

TEST_CASE("a large copy weighs more than a small one, whose time is mostly latency") {
  link_meter m(1e9, false);
  m.sample(link_direction::to_host, 64 << 20, 64e-3);  // 64 MiB at about 1 GB/s
  m.sample(link_direction::to_host, 4096, 1e-5);       // 4 KiB in 10 us: 0.4 GB/s
  CHECK(m.bytes_per_s(link_direction::to_host) > 0.95 * (64 << 20) / 64e-3);
}

TEST_CASE("a fixed bandwidth ignores samples; bad samples are ignored") {
  link_meter fixed(5e9, /*fixed=*/true);
  fixed.sample(link_direction::to_host, 1'000'000, 1.0);
  CHECK(fixed.bytes_per_s(link_direction::to_host) == 5e9);

  link_meter m(5e9, false);
  m.sample(link_direction::to_host, 0, 1e-3);
  m.sample(link_direction::to_host, 1000, -1.0);
  m.sample(link_direction::to_host, 1000, std::numeric_limits<double>::quiet_NaN());
  m.sample(link_direction::to_host, 1000, std::numeric_limits<double>::infinity());
  CHECK(m.bytes_per_s(link_direction::to_host) == 5e9);
  m.sample(link_direction::to_host, 1000, 0.0);  // within the clock's resolution: finite
  CHECK(std::isfinite(m.bytes_per_s(link_direction::to_host)));
  CHECK(m.bytes_per_s(link_direction::to_host) > 5e9);
}

TEST_CASE("copies queued on a device's copy engine delay a spill there, not elsewhere") {
  link_meter m(1e9, true);
  m.reserve_device(1);
  m.copy_queued(1, 2'000'000);
  CHECK(m.queued_bytes(1) == 2'000'000);
  CHECK(m.queued_bytes(0) == 0);
  m.copy_queued(7, 1'000'000);  // never reserved: not counted (and nothing written)
  CHECK(m.queued_bytes(7) == 0);
  // Out: (queued + bytes) / 1e9; back: bytes / 1e9.
  CHECK(m.spill_seconds(1'000'000, 1) == doctest::Approx(4e-3));
  CHECK(m.spill_seconds(1'000'000, 0) == doctest::Approx(2e-3));
  CHECK(m.spill_seconds(1'000'000, -1) == doctest::Approx(2e-3));  // a CPU storage
  m.copy_done(1, 1'500'000);
  CHECK(m.queued_bytes(1) == 500'000);
  m.copy_done(1, 1'000'000);  // more than is queued: none left, never a wrap-around
  CHECK(m.queued_bytes(1) == 0);
}
