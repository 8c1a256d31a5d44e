// test_activation_link: link_estimates and link_meter (torch_plugin/activation_link.hpp), what
// the activation managers weigh a spill by: each link's bandwidth as the bytes over the seconds
// of its recent copies, older ones decayed, per device and direction; the configured bandwidth
// until a link is measured (always, when fixed); the bytes occupying each device's copy engine,
// and the spill's time from them; and scan_copies, over events the test completes by hand.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

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
  // A storage whose host copy is kept costs its copy back only, however busy the engine out is.
  CHECK(m.restore_seconds(1'000'000, 1) == doctest::Approx(1e-3));
  CHECK(m.restore_seconds(1'000'000, 0) == doctest::Approx(1e-3));
  m.set_occupied(1, 0);  // a later count: all complete
  CHECK(m.occupied_bytes(1) == 0);
}

namespace {

// An event the test completes by hand, counting how often it is asked.
struct mock_event {
  struct state {
    bool complete = false, throws = false;
    double ms = 0;  // when it completed
    int queries = 0;
  };
  std::shared_ptr<state> s = std::make_shared<state>();

  bool query() const {
    ++s->queries;
    if (s->throws) throw std::runtime_error("mock CUDA error");
    return s->complete;
  }
  double elapsedTime(const mock_event& end) const { return end.s->ms - s->ms; }
  void complete_at(double ms) const {
    s->complete = true;
    s->ms = ms;
  }
};

struct mock_copy {
  int device;
  link_direction direction;
  std::size_t bytes;
  mock_event start, end;
  std::optional<mock_event> ready;
  bool eligible = false;
};

mock_copy copy_to_host(int device, std::size_t bytes) {
  mock_copy c{device, link_direction::to_host, bytes, {}, {}, mock_event{}};
  c.start.complete_at(0);
  return c;
}

}  // namespace

TEST_CASE("a scan samples the complete copies, keeps the others in order, asks little") {
  link_estimates shared;
  link_meter m(1e9, false, shared);
  m.reserve_device(1);
  std::vector<mock_copy> copies{copy_to_host(0, 1'000'000), copy_to_host(0, 2'000'000),
                                copy_to_host(0, 3'000'000), copy_to_host(1, 4'000'000)};
  copies[0].end.complete_at(1.0);  // 1 MB in 1 ms
  copies[2].end.complete_at(2.0);  // behind copies[1], not complete: not asked
  const mock_event second_end = copies[1].end, third_end = copies[2].end;
  for (mock_copy& c : copies) c.ready->complete_at(0);
  scan_copies(copies, m);
  CHECK(*shared.bytes_per_s(0, link_direction::to_host) == doctest::Approx(1e9));
  REQUIRE(copies.size() == 3);
  CHECK(copies[0].bytes == 2'000'000);
  CHECK(copies[1].bytes == 3'000'000);
  CHECK(copies[2].bytes == 4'000'000);
  CHECK(second_end.s->queries == 1);
  CHECK(third_end.s->queries == 0);
  // Occupancy: every copy to host whose wait passed and that has not completed.
  CHECK(m.occupied_bytes(0) == 5'000'000);
  CHECK(m.occupied_bytes(1) == 4'000'000);
  // They complete: sampled, none left, nothing occupied.
  for (mock_copy& c : copies) c.end.complete_at(3.0);
  scan_copies(copies, m);
  CHECK(copies.empty());
  CHECK(m.occupied_bytes(0) == 0);
  CHECK(m.occupied_bytes(1) == 0);
}

TEST_CASE("copies still waiting for compute do not occupy the engine, nor are asked after one") {
  link_estimates shared;
  link_meter m(1e9, false, shared);
  m.reserve_device(0);
  std::vector<mock_copy> copies{copy_to_host(0, 1'000'000), copy_to_host(0, 2'000'000),
                                copy_to_host(0, 4'000'000)};
  copies[0].ready->complete_at(0);
  const mock_event second_ready = copies[1].ready.value(), third_ready = copies[2].ready.value();
  third_ready.complete_at(0);  // its own wait passed, but it queues behind the second
  scan_copies(copies, m);
  CHECK(m.occupied_bytes(0) == 1'000'000);
  CHECK(second_ready.s->queries == 1);
  CHECK(third_ready.s->queries == 0);
  // A wait passed is remembered: the first's is not asked again.
  const mock_event first_ready = copies[0].ready.value();
  second_ready.complete_at(0);
  scan_copies(copies, m);
  CHECK(first_ready.s->queries == 1);
  CHECK(m.occupied_bytes(0) == 7'000'000);
  // Copies queued between scans count until the next one.
  m.copy_queued(0, 500'000);
  CHECK(m.occupied_bytes(0) == 7'500'000);
  scan_copies(copies, m);
  CHECK(m.occupied_bytes(0) == 7'000'000);
}

TEST_CASE("an event that cannot be asked takes its copy off the list; the scan goes on") {
  link_estimates shared;
  link_meter m(1e9, false, shared);
  m.reserve_device(0);
  std::vector<mock_copy> copies{copy_to_host(0, 1'000'000), copy_to_host(0, 2'000'000)};
  copies[0].end.s->throws = true;
  copies[1].ready->complete_at(0);
  scan_copies(copies, m);  // noexcept: a throw would terminate
  REQUIRE(copies.size() == 1);
  CHECK(copies[0].bytes == 2'000'000);
  CHECK(m.occupied_bytes(0) == 2'000'000);
  CHECK(!shared.bytes_per_s(0, link_direction::to_host).has_value());
  copies[0].end.complete_at(2.0);
  scan_copies(copies, m);
  CHECK(copies.empty());
  CHECK(*shared.bytes_per_s(0, link_direction::to_host) == doctest::Approx(1e9));
}
