// test_sim_device: the simulated device keeps the promises of sim_device.hpp.
//
// It proves: segments and mapped pages count against a fixed capacity and are real memory;
// VMM maps and unmaps at the granularity, rejects misuse naming the address, and accounts pages;
// pinned host memory has its own capacity; copies and kernel effects happen when the op completes
// (in completion order), never at enqueue, and not on a held stream; copy timing is exactly
// latency + bytes / bandwidth, copies of one direction queue on their engine; events and
// stream_wait_event order streams (a wait sees the record made before it); run_until_idle and the
// synchronize calls move the clock exactly to the completions they wait for, and throw
// std::logic_error instead of hanging behind a held stream; every fault site fails the Nth call;
// bad handles and pointers throw invalid_argument naming the value; kernel effects may call back
// into the device; the realtime clock completes work by itself; concurrent use from several
// threads stays consistent (run it under TSan).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "spillway/errors.hpp"
#include "spillway/sim_device.hpp"

using namespace spillway;

namespace {

constexpr std::size_t k_kib = 1024;
constexpr std::size_t k_mib = 1024 * k_kib;
constexpr std::size_t k_gran = 64 * k_kib;  // a multiple of the host page size

// Manual clock, one byte per nanosecond in every direction, 100 ns copy latency.
sim_config test_config() {
  sim_config c;
  c.capacity = 64 * k_mib;
  c.pinned_host_capacity = 8 * k_mib;
  c.vmm_granularity = k_gran;
  c.h2d_bandwidth = 1e9;
  c.d2h_bandwidth = 1e9;
  c.d2d_bandwidth = 1e9;
  c.copy_latency_ns = 100;
  return c;
}

template <class F>
std::string invalid_argument_text(F&& f) {
  try {
    f();
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "<no spillway::invalid_argument>";
}

// The message of a plain std::logic_error (not an invalid_argument, which is one too).
template <class F>
std::string logic_error_text(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return std::string("<invalid_argument: ") + e.what() + ">";
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "<no std::logic_error>";
}

std::string address_text(const void* p) {
  char text[32];
  std::snprintf(text, sizeof text, "%p", p);
  return text;
}

std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
  std::vector<std::uint8_t> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = static_cast<std::uint8_t>(i * 131 + seed);
  return v;
}

bool all_zero(const void* p, std::size_t bytes) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  return std::all_of(b, b + bytes, [](std::uint8_t x) { return x == 0; });
}

// A device segment released at scope exit.
struct segment {
  sim_device& dev;
  std::size_t bytes;
  void* ptr;
  segment(sim_device& d, std::size_t n) : dev(d), bytes(n), ptr(d.reserve_segment(n)) {
    REQUIRE(ptr != nullptr);
  }
  ~segment() { dev.release_segment(ptr, bytes); }
  std::uint8_t* data() const { return static_cast<std::uint8_t*>(ptr); }
};

}  // namespace

// --- identity and memory ---------------------------------------------------------------------------

TEST_CASE("identity: name, index, capacity") {
  sim_config c = test_config();
  c.device_index = 3;
  sim_device dev(c);
  CHECK(dev.name() == "sim:3");
  CHECK(dev.device_index() == 3);
  CHECK(dev.total_memory() == 64 * k_mib);
  CHECK(dev.free_memory() == 64 * k_mib);
  CHECK(dev.vmm_granularity() == k_gran);
  CHECK(dev.now_ns() == 0);
  CHECK(dev.stream_idle(stream_ref{}));
}

TEST_CASE("segments: the capacity limits reservations; release gives the bytes back") {
  sim_device dev(test_config());
  void* a = dev.reserve_segment(40 * k_mib);
  REQUIRE(a != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 512 == 0);
  CHECK(dev.reserve_segment(30 * k_mib) == nullptr);  // 70 MiB > 64 MiB
  void* b = dev.reserve_segment(24 * k_mib);
  REQUIRE(b != nullptr);
  CHECK(dev.free_memory() == 0);
  CHECK(dev.reserve_segment(1) == nullptr);

  dev.release_segment(a, 40 * k_mib);
  CHECK(dev.free_memory() == 40 * k_mib);
  void* c = dev.reserve_segment(30 * k_mib);
  REQUIRE(c != nullptr);

  dev.release_segment(nullptr, 0);                    // ignored
  int not_ours = 0;
  dev.release_segment(&not_ours, sizeof not_ours);   // ignored: not a segment
  dev.release_segment(b, 24 * k_mib);
  dev.release_segment(c, 30 * k_mib);
  dev.release_segment(c, 30 * k_mib);                // twice: ignored

  const sim_counters n = dev.counters();
  CHECK(n.used_bytes == 0);
  CHECK(n.peak_used_bytes == 64 * k_mib);
  CHECK(n.segments_reserved == 3);
  CHECK(n.segments_released == 3);
  CHECK(dev.free_memory() == 64 * k_mib);
}

TEST_CASE("segments: bytes written through a device pointer read back") {
  sim_device dev(test_config());
  segment seg(dev, 3 * k_mib + 17);
  const auto want = pattern(seg.bytes, 7);
  std::memcpy(seg.ptr, want.data(), want.size());
  CHECK(std::memcmp(seg.ptr, want.data(), want.size()) == 0);
}

TEST_CASE("segments: segment_reserve_latency_ns moves the manual clock") {
  sim_config c = test_config();
  c.segment_reserve_latency_ns = 5000;
  sim_device dev(c);
  void* p = dev.reserve_segment(k_mib);
  REQUIRE(p != nullptr);
  CHECK(dev.now_ns() == 5000);
  CHECK(dev.reserve_segment(128 * k_mib) == nullptr);  // a failed reservation costs nothing
  CHECK(dev.now_ns() == 5000);
  dev.release_segment(p, k_mib);
  CHECK(dev.now_ns() == 10000);
}

TEST_CASE("vmm: ranges are aligned; maps count against capacity; pages hold data") {
  sim_device dev(test_config());
  auto* base = static_cast<std::uint8_t*>(dev.reserve_address_range(8 * k_gran));
  REQUIRE(base != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(base) % k_gran == 0);
  CHECK(dev.counters().used_bytes == 0);  // address space is free

  REQUIRE(dev.map_physical(base, k_gran));
  REQUIRE(dev.map_physical(base + 2 * k_gran, 2 * k_gran));
  sim_counters n = dev.counters();
  CHECK(n.used_bytes == 3 * k_gran);
  CHECK(n.pages_mapped == 3);
  CHECK(dev.free_memory() == 64 * k_mib - 3 * k_gran);

  const auto want = pattern(k_gran, 3);
  std::memcpy(base + 2 * k_gran, want.data(), k_gran);
  std::memcpy(base + 3 * k_gran, want.data(), k_gran);
  CHECK(std::memcmp(base + 3 * k_gran, want.data(), k_gran) == 0);

  // Unmapping drops the contents: the page maps again as zeros.
  dev.unmap_physical(base + 2 * k_gran, k_gran);
  n = dev.counters();
  CHECK(n.used_bytes == 2 * k_gran);
  CHECK(n.pages_unmapped == 1);
  dev.unmap_physical(base + 2 * k_gran, k_gran);  // not mapped: ignored
  dev.unmap_physical(base + 5 * k_gran, k_gran);  // never mapped: ignored
  CHECK(dev.counters().pages_unmapped == 1);
  REQUIRE(dev.map_physical(base + 2 * k_gran, k_gran));
  CHECK(all_zero(base + 2 * k_gran, k_gran));
  CHECK(std::memcmp(base + 3 * k_gran, want.data(), k_gran) == 0);  // its neighbour kept its bytes

  // A span with mapped and unmapped pages unmaps the mapped ones.
  dev.unmap_physical(base, 8 * k_gran);
  CHECK(dev.counters().used_bytes == 0);
  CHECK(dev.counters().pages_unmapped == 4);
  dev.release_address_range(base, 8 * k_gran);
}

TEST_CASE("vmm: map_physical rejects misuse with invalid_argument naming the address") {
  sim_device dev(test_config());
  auto* base = static_cast<std::uint8_t*>(dev.reserve_address_range(4 * k_gran));
  REQUIRE(base != nullptr);
  REQUIRE(dev.map_physical(base + k_gran, 2 * k_gran));

  // Double map: the message names the page that is already mapped.
  std::string text = invalid_argument_text([&] { dev.map_physical(base, 2 * k_gran); });
  CHECK(text.find("already mapped") != std::string::npos);
  CHECK(text.find(address_text(base + k_gran)) != std::string::npos);

  text = invalid_argument_text([&] { dev.map_physical(base + 512, k_gran); });
  CHECK(text.find(address_text(base + 512)) != std::string::npos);
  CHECK(text.find("granularity") != std::string::npos);
  text = invalid_argument_text([&] { dev.map_physical(base, k_gran / 2); });
  CHECK(text.find("32.00 KiB") != std::string::npos);
  text = invalid_argument_text([&] { dev.map_physical(base + 3 * k_gran, 2 * k_gran); });  // overruns
  CHECK(text.find("reserved address range") != std::string::npos);
  std::vector<std::uint8_t> host(2 * k_gran);
  auto* outside = reinterpret_cast<std::uint8_t*>(
      (reinterpret_cast<std::uintptr_t>(host.data()) + k_gran - 1) / k_gran * k_gran);
  text = invalid_argument_text([&] { dev.map_physical(outside, k_gran); });
  CHECK(text.find(address_text(outside)) != std::string::npos);

  text = invalid_argument_text([&] { dev.reserve_address_range(k_gran + 1); });
  CHECK(text.find(std::to_string(k_gran + 1)) != std::string::npos);
  CHECK(invalid_argument_text([&] { dev.reserve_address_range(0); }).find("size 0") !=
        std::string::npos);

  CHECK(dev.counters().used_bytes == 2 * k_gran);  // nothing changed
  dev.release_address_range(base, 4 * k_gran);     // also uncounts the pages still mapped
  CHECK(dev.counters().used_bytes == 0);
  dev.release_address_range(base, 4 * k_gran);  // unknown now: ignored
}

TEST_CASE("vmm: pages and segments share the capacity; over it map_physical is false") {
  sim_config c = test_config();
  c.capacity = 4 * k_gran;
  sim_device dev(c);
  auto* base = static_cast<std::uint8_t*>(dev.reserve_address_range(16 * k_gran));  // > capacity
  REQUIRE(base != nullptr);
  void* seg = dev.reserve_segment(k_gran);
  REQUIRE(seg != nullptr);
  REQUIRE(dev.map_physical(base, 3 * k_gran));
  CHECK_FALSE(dev.map_physical(base + 3 * k_gran, k_gran));
  CHECK(dev.counters().pages_mapped == 3);
  dev.release_segment(seg, k_gran);
  CHECK(dev.map_physical(base + 3 * k_gran, k_gran));
  CHECK(dev.free_memory() == 0);
  dev.unmap_physical(base, 4 * k_gran);
  CHECK(dev.free_memory() == 4 * k_gran);
  dev.release_address_range(base, 16 * k_gran);
}

TEST_CASE("vmm: granularity 0 disables it and VMM calls throw invalid_argument") {
  sim_config c = test_config();
  c.vmm_granularity = 0;
  sim_device dev(c);
  CHECK(dev.vmm_granularity() == 0);
  CHECK_THROWS_AS(dev.reserve_address_range(k_gran), spillway::invalid_argument);
  int x = 0;
  CHECK_THROWS_AS(dev.map_physical(&x, k_gran), spillway::invalid_argument);
  dev.unmap_physical(&x, k_gran);            // noexcept: ignored
  dev.release_address_range(&x, k_gran);     // noexcept: ignored
}

TEST_CASE("pinned host memory has its own capacity") {
  sim_device dev(test_config());
  void* a = dev.allocate_pinned_host(6 * k_mib);
  REQUIRE(a != nullptr);
  CHECK(dev.allocate_pinned_host(4 * k_mib) == nullptr);
  CHECK(dev.counters().pinned_used_bytes == 6 * k_mib);
  CHECK(dev.counters().used_bytes == 0);  // not device memory
  std::memset(a, 0xab, 6 * k_mib);
  CHECK(static_cast<std::uint8_t*>(a)[6 * k_mib - 1] == 0xab);
  dev.free_pinned_host(a, 6 * k_mib);
  void* b = dev.allocate_pinned_host(4 * k_mib);
  CHECK(b != nullptr);
  dev.free_pinned_host(b, 4 * k_mib);
  dev.free_pinned_host(nullptr, 0);
  CHECK(dev.counters().pinned_used_bytes == 0);
  CHECK(invalid_argument_text([&] { dev.allocate_pinned_host(0); }).find("size 0") != std::string::npos);
}

// --- copies and the clock --------------------------------------------------------------------------

TEST_CASE("copies: the bytes move when the copy completes, not when it is enqueued") {
  sim_device dev(test_config());
  segment dst(dev, 1000);
  std::memset(dst.ptr, 0, 1000);
  const auto src = pattern(1000, 9);
  dev.copy_async(dst.ptr, src.data(), 1000, copy_kind::host_to_device, stream_ref{});
  CHECK(all_zero(dst.ptr, 1000));
  CHECK_FALSE(dev.stream_idle(stream_ref{}));
  dev.advance(1099);  // 100 ns latency + 1000 bytes at 1 byte/ns
  CHECK(all_zero(dst.ptr, 1000));
  CHECK_FALSE(dev.stream_idle(stream_ref{}));
  dev.advance(1);
  CHECK(std::memcmp(dst.ptr, src.data(), 1000) == 0);
  CHECK(dev.stream_idle(stream_ref{}));
  CHECK(dev.now_ns() == 1100);
}

TEST_CASE("copies: a held stream copies nothing until it is released") {
  sim_device dev(test_config());
  const stream_ref s = dev.create_stream();
  segment dst(dev, 4096);
  std::memset(dst.ptr, 0, 4096);
  const auto src = pattern(4096, 1);
  dev.hold(s);
  dev.copy_async(dst.ptr, src.data(), 4096, copy_kind::host_to_device, s);
  dev.run_until_idle();
  dev.advance(1'000'000);
  CHECK(all_zero(dst.ptr, 4096));
  CHECK_FALSE(dev.stream_idle(s));
  dev.release(s);  // at t = 1'000'000: the copy starts now
  CHECK(all_zero(dst.ptr, 4096));
  dev.run_until_idle();
  CHECK(std::memcmp(dst.ptr, src.data(), 4096) == 0);
  CHECK(dev.now_ns() == 1'000'000 + 100 + 4096);
  CHECK(dev.stream_idle(s));
}

TEST_CASE("copies: hold stops a running copy; it restarts in full at release") {
  sim_device dev(test_config());
  const stream_ref s1 = dev.create_stream(), s2 = dev.create_stream();
  segment dev_buf(dev, 2000);
  std::vector<std::uint8_t> host1(1000, 0), host2(1000, 0);
  std::memset(dev_buf.ptr, 0x11, 2000);
  dev.copy_async(host1.data(), dev_buf.data(), 1000, copy_kind::device_to_host, s1);  // 0..1100
  dev.copy_async(host2.data(), dev_buf.data() + 1000, 1000, copy_kind::device_to_host, s2);  // queued
  const event_ref e1 = dev.create_event(), e2 = dev.create_event();
  dev.record_event(e1, s1);
  dev.record_event(e2, s2);
  dev.advance(500);
  dev.hold(s1);  // s1's copy stops and gives the d2h engine to s2's, which starts at 500
  dev.advance(1099);
  CHECK_FALSE(dev.event_completed(e2));
  dev.advance(1);  // t = 1600
  CHECK(dev.event_completed(e2));
  CHECK(host2[0] == 0x11);
  CHECK(host1[0] == 0);
  dev.advance(400);  // t = 2000
  CHECK_FALSE(dev.event_completed(e1));
  dev.release(s1);
  dev.synchronize_event(e1);
  CHECK(dev.now_ns() == 2000 + 1100);
  CHECK(host1[999] == 0x11);
}

TEST_CASE("copies: duration is latency + bytes / bandwidth of the direction") {
  sim_config c = test_config();
  c.h2d_bandwidth = 2e9;
  c.d2h_bandwidth = 1e9;
  c.d2d_bandwidth = 4e9;
  c.copy_latency_ns = 50;
  sim_device dev(c);
  segment d(dev, 8000);
  std::vector<std::uint8_t> h(8000, 5);
  auto timed_copy = [&](void* dst, const void* src, copy_kind kind) {
    const std::uint64_t t0 = dev.now_ns();
    dev.copy_async(dst, src, 4000, kind, stream_ref{});
    dev.synchronize_stream(stream_ref{});
    return dev.now_ns() - t0;
  };
  CHECK(timed_copy(d.ptr, h.data(), copy_kind::host_to_device) == 50 + 2000);
  CHECK(timed_copy(h.data(), d.ptr, copy_kind::device_to_host) == 50 + 4000);
  CHECK(timed_copy(d.data() + 4000, d.ptr, copy_kind::device_to_device) == 50 + 1000);
  CHECK(timed_copy(h.data() + 4000, h.data(), copy_kind::host_to_host) == 50 + 1000);
}

TEST_CASE("copies: the default model is PCIe at 50 GB/s with 2 us latency") {
  sim_device dev;  // manual clock, defaults
  std::vector<std::uint8_t> host(k_mib, 1);
  void* d = dev.reserve_segment(k_mib);
  REQUIRE(d != nullptr);
  dev.copy_async(d, host.data(), k_mib, copy_kind::host_to_device, stream_ref{});
  dev.synchronize_stream(stream_ref{});
  CHECK(dev.now_ns() == 2000 + 20972);  // 1048576 B / 50 GB/s = 20971.52 ns, rounded
  dev.release_segment(d, k_mib);
}

TEST_CASE("copies: one engine per direction; same-direction copies queue behind each other") {
  sim_device dev(test_config());
  const stream_ref s1 = dev.create_stream(), s2 = dev.create_stream(), s3 = dev.create_stream();
  segment d(dev, 4000);
  std::vector<std::uint8_t> h(4000, 2);
  const event_ref e1 = dev.create_event(), e2 = dev.create_event(), e3 = dev.create_event();

  SUBCASE("two device_to_host copies: the second completes at twice the time") {
    dev.copy_async(h.data(), d.ptr, 1000, copy_kind::device_to_host, s1);
    dev.copy_async(h.data() + 1000, d.data() + 1000, 1000, copy_kind::device_to_host, s2);
    dev.record_event(e1, s1);
    dev.record_event(e2, s2);
    dev.advance(1100);
    CHECK(dev.event_completed(e1));
    CHECK_FALSE(dev.event_completed(e2));
    CHECK_FALSE(dev.stream_idle(s2));
    dev.advance(1099);
    CHECK_FALSE(dev.event_completed(e2));
    dev.advance(1);
    CHECK(dev.event_completed(e2));
  }
  SUBCASE("opposite directions run side by side") {
    dev.copy_async(h.data(), d.ptr, 1000, copy_kind::device_to_host, s1);
    dev.copy_async(d.data() + 1000, h.data() + 1000, 1000, copy_kind::host_to_device, s2);
    dev.copy_async(d.data() + 2000, d.ptr, 1000, copy_kind::device_to_device, s3);
    dev.record_event(e1, s1);
    dev.record_event(e2, s2);
    dev.record_event(e3, s3);
    dev.advance(1100);
    CHECK(dev.event_completed(e1));
    CHECK(dev.event_completed(e2));
    CHECK(dev.event_completed(e3));
  }
  SUBCASE("device_to_device and host_to_host share an engine") {
    dev.copy_async(d.data() + 2000, d.ptr, 1000, copy_kind::device_to_device, s1);
    dev.copy_async(h.data() + 2000, h.data(), 1000, copy_kind::host_to_host, s2);
    dev.record_event(e2, s2);
    dev.synchronize_event(e2);
    CHECK(dev.now_ns() == 2200);
  }
  SUBCASE("a queued copy keeps its place: first come, first served") {
    dev.copy_async(h.data(), d.ptr, 1000, copy_kind::device_to_host, s1);      // 0..1100
    dev.copy_async(h.data() + 1000, d.ptr, 1000, copy_kind::device_to_host, s2);  // 1100..2200
    dev.copy_async(h.data() + 2000, d.ptr, 10, copy_kind::device_to_host, s3);   // 2200..2310
    dev.record_event(e3, s3);
    dev.synchronize_event(e3);
    CHECK(dev.now_ns() == 2310);
  }
  SUBCASE("0-byte copies are no-ops: no engine, no time, nullptr allowed") {
    dev.copy_async(h.data(), d.ptr, 1000, copy_kind::device_to_host, s1);
    dev.copy_async(nullptr, nullptr, 0, copy_kind::device_to_host, s2);
    CHECK(dev.stream_idle(s2));
    CHECK(dev.now_ns() == 0);
  }
}

TEST_CASE("streams: work runs in FIFO order on its stream") {
  sim_device dev(test_config());
  segment d(dev, 1000);
  std::vector<std::uint8_t> h(1000, 4);
  std::vector<std::string> order;
  dev.launch(stream_ref{}, 5000, [&] { order.push_back("kernel@" + std::to_string(dev.now_ns())); });
  dev.copy_async(d.ptr, h.data(), 1000, copy_kind::host_to_device, stream_ref{});
  dev.launch(stream_ref{}, 0, [&] {
    order.push_back("check@" + std::to_string(dev.now_ns()) + ":" + std::to_string(d.data()[999]));
  });
  dev.run_until_idle();
  CHECK(order == std::vector<std::string>{"kernel@5000", "check@6100:4"});
  CHECK(dev.now_ns() == 6100);
}

TEST_CASE("kernels: effects run at completion, in completion order, and may call the device") {
  sim_device dev(test_config());
  const stream_ref s1 = dev.create_stream(), s2 = dev.create_stream(), s3 = dev.create_stream();
  std::vector<int> order;
  std::vector<std::uint64_t> times;
  dev.launch(s1, 300, [&] { order.push_back(1); times.push_back(dev.now_ns()); });
  dev.launch(s2, 100, [&] { order.push_back(2); times.push_back(dev.now_ns()); });
  dev.launch(s3, 200, [&] {
    order.push_back(3);
    times.push_back(dev.now_ns());
    // Re-entrant calls from an effect: enqueue, record, query. No deadlock, no lost work.
    const event_ref e = dev.create_event();
    dev.launch(s3, 50, [&] { order.push_back(4); });
    dev.record_event(e, s3);
    CHECK_FALSE(dev.event_completed(e));
    CHECK_FALSE(dev.stream_idle(s3));  // this kernel and the one behind it
  });
  CHECK(order.empty());
  dev.run_until_idle();
  CHECK(order == std::vector<int>{2, 3, 4, 1});
  CHECK(times == std::vector<std::uint64_t>{100, 200, 300});
  CHECK(dev.counters().kernels == 4);
  CHECK(dev.now_ns() == 300);
}

TEST_CASE("kernels: a kernel of duration 0 on an idle stream completes at once") {
  sim_device dev(test_config());
  bool ran = false;
  dev.launch(stream_ref{}, 0, [&] { ran = true; });
  CHECK(ran);
  CHECK(dev.now_ns() == 0);
}

TEST_CASE("kernels: a kernel that never ends does not wrap the clock round") {
  sim_device dev(test_config());
  const stream_ref s = dev.create_stream();
  const event_ref e = dev.create_event();
  dev.advance(1000);
  dev.launch(s, UINT64_MAX);
  dev.record_event(e, s);
  dev.advance(1'000'000'000);
  CHECK_FALSE(dev.event_completed(e));
  CHECK_FALSE(dev.stream_idle(s));
}

TEST_CASE("kernels: an effect's exception propagates; the kernel still completes") {
  sim_device dev(test_config());
  const stream_ref s = dev.create_stream();
  dev.launch(s, 10, [] { throw std::runtime_error("effect failed"); });
  bool after = false;
  dev.launch(s, 10, [&] { after = true; });
  CHECK_THROWS_WITH_AS(dev.run_until_idle(), "effect failed", std::runtime_error);
  CHECK(dev.counters().kernels == 1);
  dev.run_until_idle();
  CHECK(after);
  CHECK(dev.stream_idle(s));
}

TEST_CASE("kernels: an effect cannot synchronize on its own stream (logic_error, not a hang)") {
  sim_device dev(test_config());
  const stream_ref s = dev.create_stream(), other = dev.create_stream();
  std::string own, device_wide;
  bool other_synced = false;
  dev.launch(other, 1000);
  dev.launch(s, 10, [&] {
    own = logic_error_text([&] { dev.synchronize_stream(s); });
    dev.synchronize_stream(other);  // independent work: fine, the clock moves on
    other_synced = dev.stream_idle(other);
    device_wide = logic_error_text([&] { dev.synchronize_device(); });
  });
  dev.run_until_idle();
  CHECK(own.find("this thread") != std::string::npos);
  CHECK(device_wide.find("this thread") != std::string::npos);
  CHECK(other_synced);
  CHECK(dev.stream_idle(s));
  CHECK(dev.counters().kernels == 2);
}

// --- events ----------------------------------------------------------------------------------------

TEST_CASE("events: complete when the work before them has run; never recorded counts as done") {
  sim_device dev(test_config());
  const stream_ref s = dev.create_stream();
  const event_ref e = dev.create_event();
  CHECK(e.value != 0);
  CHECK(dev.event_completed(e));  // never recorded
  dev.synchronize_event(e);       // returns at once
  dev.stream_wait_event(s, e);    // no-op
  CHECK(dev.stream_idle(s));

  dev.record_event(e, s);  // idle stream: done at once, no time passes
  CHECK(dev.event_completed(e));
  CHECK(dev.now_ns() == 0);

  dev.launch(s, 700);
  dev.record_event(e, s);
  CHECK_FALSE(dev.event_completed(e));
  dev.advance(699);
  CHECK_FALSE(dev.event_completed(e));  // a pure query: the clock stays
  CHECK(dev.now_ns() == 699);
  dev.advance(1);
  CHECK(dev.event_completed(e));
}

TEST_CASE("events: stream_wait_event orders work across streams") {
  sim_device dev(test_config());
  const stream_ref producer = dev.create_stream(), consumer = dev.create_stream();
  const event_ref ready = dev.create_event();
  int value = 0;
  int seen = -1;
  std::uint64_t seen_at = 0;
  dev.launch(producer, 1000, [&] { value = 1; });
  dev.record_event(ready, producer);
  dev.stream_wait_event(consumer, ready);
  dev.launch(consumer, 10, [&] {
    seen = value;
    seen_at = dev.now_ns();
  });
  dev.advance(500);
  CHECK(seen == -1);
  dev.synchronize_stream(consumer);
  CHECK(seen == 1);
  CHECK(seen_at == 1010);
  CHECK(dev.now_ns() == 1010);
}

TEST_CASE("events: a wait sees the record made before it, not a later one") {
  sim_device dev(test_config());
  const stream_ref a = dev.create_stream(), b = dev.create_stream(), c = dev.create_stream();
  const event_ref e = dev.create_event();
  dev.launch(a, 1000);
  dev.record_event(e, a);
  dev.stream_wait_event(b, e);
  dev.record_event(e, c);      // re-recorded on an idle stream: e is complete at once
  CHECK(dev.event_completed(e));
  dev.destroy_event(e);        // destroying it does not cancel b's wait
  std::uint64_t ran_at = 0;
  dev.launch(b, 10, [&] { ran_at = dev.now_ns(); });
  dev.run_until_idle();
  CHECK(ran_at == 1010);
  CHECK(invalid_argument_text([&] { dev.event_completed(e); }).find(std::to_string(e.value)) !=
        std::string::npos);
}

TEST_CASE("events: waits chain across several streams") {
  sim_device dev(test_config());
  std::vector<stream_ref> s;
  for (int i = 0; i < 4; ++i) s.push_back(dev.create_stream());
  std::vector<int> order;
  for (int i = 0; i < 4; ++i) {
    if (i > 0) {
      const event_ref e = dev.create_event();
      dev.record_event(e, s[i - 1]);
      dev.stream_wait_event(s[i], e);
    }
    dev.launch(s[i], 100 * static_cast<std::uint64_t>(4 - i), [&order, i] { order.push_back(i); });
  }
  dev.synchronize_stream(s[3]);
  CHECK(order == std::vector<int>{0, 1, 2, 3});
  CHECK(dev.now_ns() == 400 + 300 + 200 + 100);
}

// --- run_until_idle, synchronize, hold -------------------------------------------------------------

TEST_CASE("run_until_idle completes everything that can complete and stops at the last end") {
  sim_device dev(test_config());
  const stream_ref a = dev.create_stream(), b = dev.create_stream(), held = dev.create_stream();
  int done = 0;
  dev.hold(held);
  dev.launch(held, 10, [&] { ++done; });
  dev.launch(a, 300, [&] { ++done; });
  dev.launch(b, 200, [&] { ++done; });
  dev.launch(b, 200, [&] { ++done; });
  dev.run_until_idle();
  CHECK(done == 3);
  CHECK(dev.now_ns() == 400);
  CHECK(dev.stream_idle(a));
  CHECK_FALSE(dev.stream_idle(held));
  dev.run_until_idle();  // nothing left that can run: returns, the clock stays
  CHECK(dev.now_ns() == 400);
  dev.release(held);
  dev.run_until_idle();
  CHECK(done == 4);
  CHECK(dev.now_ns() == 410);
}

TEST_CASE("synchronize_*: return with the clock at the completion they wait for") {
  sim_device dev(test_config());
  const stream_ref a = dev.create_stream(), b = dev.create_stream();
  dev.launch(a, 500);
  dev.launch(b, 900);
  dev.synchronize_stream(a);
  CHECK(dev.now_ns() == 500);
  CHECK_FALSE(dev.stream_idle(b));
  dev.launch(a, 1000);
  dev.synchronize_device();
  CHECK(dev.now_ns() == 1500);
  CHECK(dev.stream_idle(a));
  CHECK(dev.stream_idle(b));
  dev.synchronize_stream(a);  // idle: returns at once
  dev.synchronize_device();
  CHECK(dev.now_ns() == 1500);
}

TEST_CASE("synchronize_*: work behind a held stream throws std::logic_error and runs nothing") {
  sim_device dev(test_config());
  const stream_ref held = dev.create_stream(), waiter = dev.create_stream(), busy = dev.create_stream();
  const event_ref e = dev.create_event(), after_wait = dev.create_event();
  dev.hold(held);
  dev.launch(held, 10);
  dev.record_event(e, held);
  dev.stream_wait_event(waiter, e);
  dev.launch(waiter, 10);
  dev.record_event(after_wait, waiter);
  bool busy_ran = false;
  dev.launch(busy, 5000, [&] { busy_ran = true; });

  const std::string held_name = "stream " + std::to_string(held.value);
  std::string text = logic_error_text([&] { dev.synchronize_stream(held); });
  CHECK(text.find(held_name + " is held") != std::string::npos);
  text = logic_error_text([&] { dev.synchronize_stream(waiter); });
  CHECK(text.find(held_name) != std::string::npos);
  CHECK(text.find("synchronize_stream(" + std::to_string(waiter.value) + ")") != std::string::npos);
  text = logic_error_text([&] { dev.synchronize_event(e); });
  CHECK(text.find(held_name) != std::string::npos);
  text = logic_error_text([&] { dev.synchronize_event(after_wait); });
  CHECK(text.find(held_name) != std::string::npos);
  text = logic_error_text([&] { dev.synchronize_device(); });
  CHECK(text.find(held_name) != std::string::npos);
  CHECK(dev.now_ns() == 0);  // the failed waits moved nothing
  CHECK_FALSE(busy_ran);

  dev.synchronize_stream(busy);  // independent of the held stream: fine
  CHECK(busy_ran);
  dev.release(held);
  dev.synchronize_event(after_wait);
  CHECK(dev.now_ns() == 5000 + 10 + 10);
  dev.synchronize_device();
}

TEST_CASE("streams: destroy_stream lets queued work finish; the handle is gone") {
  sim_device dev(test_config());
  const stream_ref s = dev.create_stream();
  bool ran = false;
  dev.hold(s);
  dev.launch(s, 100, [&] { ran = true; });
  dev.destroy_stream(s);  // lifts the hold: nobody could release it any more
  CHECK(invalid_argument_text([&] { dev.stream_idle(s); }).find(std::to_string(s.value)) !=
        std::string::npos);
  CHECK_THROWS_AS(dev.launch(s, 1), spillway::invalid_argument);
  dev.run_until_idle();
  CHECK(ran);
  dev.destroy_stream(stream_ref{});          // the default stream stays
  dev.destroy_stream(stream_ref{12345});     // unknown: ignored
  dev.destroy_stream(s);                     // twice: ignored
  dev.launch(stream_ref{}, 1);
  dev.run_until_idle();
  const stream_ref t = dev.create_stream();
  CHECK(t != s);  // handles are not reused
  dev.destroy_stream(t);
}

// --- fault injection -------------------------------------------------------------------------------

TEST_CASE("faults: each site fails its Nth call from now, once") {
  sim_device dev(test_config());

  SUBCASE("segment_reservation") {
    dev.fail_nth(fault_site::segment_reservation, 2);
    void* a = dev.reserve_segment(k_mib);
    CHECK(a != nullptr);
    void* r = dev.reserve_address_range(k_gran);  // not a segment reservation
    CHECK(r != nullptr);
    CHECK(dev.reserve_segment(k_mib) == nullptr);
    void* b = dev.reserve_segment(k_mib);
    CHECK(b != nullptr);
    CHECK(dev.counters().faults_injected == 1);
    CHECK(dev.counters().used_bytes == 2 * k_mib);
    dev.release_segment(a, k_mib);
    dev.release_segment(b, k_mib);
    dev.release_address_range(r, k_gran);
  }
  SUBCASE("page_map (misuse does not spend the fault)") {
    auto* base = static_cast<std::uint8_t*>(dev.reserve_address_range(4 * k_gran));
    dev.fail_nth(fault_site::page_map, 1);
    CHECK_THROWS_AS(dev.map_physical(base + 1, k_gran), spillway::invalid_argument);
    CHECK_FALSE(dev.map_physical(base, k_gran));
    CHECK(dev.counters().pages_mapped == 0);
    CHECK(dev.counters().used_bytes == 0);
    CHECK(dev.map_physical(base, k_gran));  // pages of a failed map are free to map
    CHECK(dev.counters().faults_injected == 1);
    dev.release_address_range(base, 4 * k_gran);
  }
  SUBCASE("pinned_host_allocation") {
    dev.fail_nth(fault_site::pinned_host_allocation, 1);
    CHECK(dev.allocate_pinned_host(4096) == nullptr);
    void* p = dev.allocate_pinned_host(4096);
    CHECK(p != nullptr);
    CHECK(dev.counters().pinned_used_bytes == 4096);
    dev.free_pinned_host(p, 4096);
  }
  SUBCASE("copy: throws device_error and enqueues nothing") {
    std::vector<std::uint8_t> a(64, 1), b(64, 0);
    dev.fail_nth(fault_site::copy, 1);
    try {
      dev.copy_async(b.data(), a.data(), 64, copy_kind::host_to_host, stream_ref{});
      FAIL("no device_error");
    } catch (const device_error& e) {
      CHECK(std::string(e.what()).find("injected") != std::string::npos);
    }
    CHECK(dev.stream_idle(stream_ref{}));
    dev.run_until_idle();
    CHECK(b[0] == 0);
    CHECK(dev.counters().copies == 0);
    dev.copy_async(b.data(), a.data(), 64, copy_kind::host_to_host, stream_ref{});
    dev.run_until_idle();
    CHECK(b[0] == 1);
    CHECK(dev.counters().faults_injected == 1);
  }
  SUBCASE("n = 0 clears a site; clear_faults clears all") {
    dev.fail_nth(fault_site::segment_reservation, 1);
    dev.fail_nth(fault_site::segment_reservation, 0);
    dev.fail_nth(fault_site::pinned_host_allocation, 1);
    dev.fail_nth(fault_site::copy, 1);
    dev.clear_faults();
    void* s = dev.reserve_segment(4096);
    void* p = dev.allocate_pinned_host(4096);
    CHECK(s != nullptr);
    CHECK(p != nullptr);
    std::uint8_t x = 0, y = 1;
    CHECK_NOTHROW(dev.copy_async(&x, &y, 1, copy_kind::host_to_host, stream_ref{}));
    CHECK(dev.counters().faults_injected == 0);
    dev.release_segment(s, 4096);
    dev.free_pinned_host(p, 4096);
    dev.run_until_idle();
  }
}

// --- invalid input ---------------------------------------------------------------------------------

TEST_CASE("invalid input throws spillway::invalid_argument naming the value") {
  sim_device dev(test_config());
  std::uint8_t a = 0, b = 0;
  const event_ref e = dev.create_event();
  const stream_ref bad_stream{99}, s = dev.create_stream();
  const event_ref bad_event{77};
  auto names = [](const std::string& text, const std::string& value) {
    INFO(text);
    CHECK(text.find(value) != std::string::npos);
  };
  names(invalid_argument_text([&] { dev.copy_async(&a, &b, 1, copy_kind::host_to_host, bad_stream); }),
        "unknown stream 99");
  names(invalid_argument_text([&] { dev.copy_async(nullptr, &b, 1, copy_kind::host_to_host, s); }), "dst");
  names(invalid_argument_text([&] { dev.copy_async(&a, nullptr, 1, copy_kind::host_to_host, s); }), "src");
  names(invalid_argument_text(
            [&] { dev.copy_async(&a, &b, 1, static_cast<copy_kind>(9), s); }),
        "copy_kind 9");
  names(invalid_argument_text([&] { dev.record_event(bad_event, s); }), "unknown event 77");
  names(invalid_argument_text([&] { dev.record_event(e, stream_ref{55}); }), "unknown stream 55");
  names(invalid_argument_text([&] { dev.event_completed(event_ref{123}); }), "unknown event 123");
  names(invalid_argument_text([&] { dev.synchronize_event(event_ref{43}); }), "unknown event 43");
  names(invalid_argument_text([&] { dev.synchronize_stream(stream_ref{42}); }), "unknown stream 42");
  names(invalid_argument_text([&] { dev.stream_wait_event(stream_ref{44}, e); }), "unknown stream 44");
  names(invalid_argument_text([&] { dev.stream_wait_event(s, event_ref{45}); }), "unknown event 45");
  names(invalid_argument_text([&] { dev.launch(stream_ref{46}, 1); }), "unknown stream 46");
  names(invalid_argument_text([&] { dev.hold(stream_ref{47}); }), "unknown stream 47");
  names(invalid_argument_text([&] { dev.release(stream_ref{48}); }), "unknown stream 48");
  names(invalid_argument_text([&] { dev.stream_idle(stream_ref{49}); }), "unknown stream 49");
  names(invalid_argument_text([&] { dev.reserve_segment(0); }), "size 0");
  names(invalid_argument_text([&] { dev.fail_nth(static_cast<fault_site>(7), 1); }), "fault_site 7");
  dev.destroy_event(e);
  names(invalid_argument_text([&] { dev.event_completed(e); }), "unknown event " + std::to_string(e.value));
  dev.destroy_event(e);  // twice: ignored

  sim_config c = test_config();
  c.d2h_bandwidth = 0;
  names(invalid_argument_text([&] { sim_device broken(c); }), "bandwidths must be positive");
  CHECK(dev.stream_idle(s));  // nothing was enqueued by the failed calls
}

TEST_CASE("counters: copies and kernels are counted by kind when they complete") {
  sim_device dev(test_config());
  segment d(dev, 4096);
  std::vector<std::uint8_t> h(4096, 1);
  dev.copy_async(d.ptr, h.data(), 4096, copy_kind::host_to_device, stream_ref{});
  dev.copy_async(h.data(), d.ptr, 1000, copy_kind::device_to_host, stream_ref{});
  dev.copy_async(d.data() + 2048, d.ptr, 2048, copy_kind::device_to_device, stream_ref{});
  dev.launch(stream_ref{}, 10);
  CHECK(dev.counters().copies == 0);
  dev.run_until_idle();
  const sim_counters n = dev.counters();
  CHECK(n.copies == 3);
  CHECK(n.bytes_copied[static_cast<int>(copy_kind::host_to_device)] == 4096);
  CHECK(n.bytes_copied[static_cast<int>(copy_kind::device_to_host)] == 1000);
  CHECK(n.bytes_copied[static_cast<int>(copy_kind::device_to_device)] == 2048);
  CHECK(n.bytes_copied[static_cast<int>(copy_kind::host_to_host)] == 0);
  CHECK(n.kernels == 1);
}

// --- realtime clock --------------------------------------------------------------------------------

TEST_CASE("realtime: work completes by itself as wall time passes") {
  sim_config c = test_config();
  c.clock = clock_mode::realtime;
  sim_device dev(c);
  std::atomic<bool> ran{false};
  const stream_ref s = dev.create_stream();
  const event_ref e = dev.create_event();
  dev.launch(s, 1'000'000, [&] { ran = true; });  // 1 ms
  dev.record_event(e, s);
  bool completed = false;
  for (int i = 0; i < 10'000 && !completed; ++i) {  // up to ~10 s: generous for a loaded machine
    completed = dev.event_completed(e);
    if (!completed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(completed);
  CHECK(ran.load());
  CHECK(dev.stream_idle(s));
}

TEST_CASE("realtime: synchronize jumps the clock instead of sleeping; it stays monotonic") {
  sim_config c = test_config();
  c.clock = clock_mode::realtime;
  sim_device dev(c);
  constexpr std::uint64_t k_hour = 3'600'000'000'000;
  const std::uint64_t before = dev.now_ns();
  dev.launch(stream_ref{}, k_hour);
  dev.synchronize_stream(stream_ref{});
  const std::uint64_t after = dev.now_ns();
  CHECK(after >= before + k_hour);
  CHECK(dev.now_ns() >= after);
  dev.advance(k_hour);  // realtime: adds to the clock as well
  CHECK(dev.now_ns() >= after + k_hour);
}

// --- threads ---------------------------------------------------------------------------------------

namespace {

// Each worker owns a stream and a slice of a device segment: it copies its pattern in, makes its
// stream wait for a neighbour's latest record, launches a kernel that checks the slice, records
// its event and polls the others. At the end every slice holds its pattern and every kernel saw it.
void run_workers(sim_device& dev, bool drive_clock) {
  constexpr int k_workers = 4;
  constexpr int k_rounds = 200;
  constexpr std::size_t k_slice = 4096;
  segment d(dev, k_workers * k_slice);
  std::vector<std::vector<std::uint8_t>> src;
  std::vector<stream_ref> streams;
  std::vector<event_ref> events;
  for (int w = 0; w < k_workers; ++w) {
    src.push_back(pattern(k_slice, static_cast<std::uint8_t>(w + 1)));
    streams.push_back(dev.create_stream());
    events.push_back(dev.create_event());
  }
  std::atomic<int> kernels_ok{0}, kernels_bad{0}, finished{0};
  std::atomic<std::uint64_t> queries{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < k_workers; ++w) {
    threads.emplace_back([&, w] {
      std::uint8_t* slice = d.data() + w * k_slice;
      for (int r = 0; r < k_rounds; ++r) {
        dev.copy_async(slice, src[w].data(), k_slice, copy_kind::host_to_device, streams[w]);
        dev.stream_wait_event(streams[w], events[(w + 1) % k_workers]);
        dev.launch(streams[w], 50, [&, slice, w] {
          if (std::memcmp(slice, src[w].data(), k_slice) == 0)
            kernels_ok.fetch_add(1);
          else
            kernels_bad.fetch_add(1);
        });
        dev.record_event(events[w], streams[w]);
        for (const event_ref e : events) queries += dev.event_completed(e) ? 1 : 0;
        (void)dev.stream_idle(streams[(w + 2) % k_workers]);
        (void)dev.counters();
      }
      finished.fetch_add(1);
    });
  }
  if (drive_clock) {
    threads.emplace_back([&] {
      while (finished.load() < k_workers) dev.advance(1000);
    });
  }
  for (auto& t : threads) t.join();
  dev.synchronize_device();
  CHECK(kernels_ok.load() == k_workers * k_rounds);
  CHECK(kernels_bad.load() == 0);
  for (int w = 0; w < k_workers; ++w) {
    CHECK(std::memcmp(d.data() + w * k_slice, src[w].data(), k_slice) == 0);
    CHECK(dev.stream_idle(streams[w]));
    CHECK(dev.event_completed(events[w]));
    dev.destroy_stream(streams[w]);
    dev.destroy_event(events[w]);
  }
  const sim_counters n = dev.counters();
  CHECK(n.copies == k_workers * k_rounds);
  CHECK(n.kernels == k_workers * k_rounds);
}

}  // namespace

TEST_CASE("threads: concurrent enqueue, record, wait and query (manual clock driven by a thread)") {
  sim_device dev(test_config());
  run_workers(dev, true);
}

TEST_CASE("threads: concurrent enqueue, record, wait and query (realtime clock)") {
  sim_config c = test_config();
  c.clock = clock_mode::realtime;
  c.time_scale = 100.0;  // 100 simulated ns per wall ns: work finishes quickly
  sim_device dev(c);
  run_workers(dev, false);
}

TEST_CASE("threads: synchronize from several threads while effects run elsewhere") {
  sim_device dev(test_config());
  constexpr int k_threads = 3;
  std::vector<stream_ref> streams;
  for (int i = 0; i < k_threads; ++i) streams.push_back(dev.create_stream());
  std::atomic<int> effects{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < k_threads; ++i) {
    threads.emplace_back([&, i] {
      for (int r = 0; r < 100; ++r) {
        dev.launch(streams[i], 10 + static_cast<std::uint64_t>(r % 7), [&] {
          effects.fetch_add(1);
          std::this_thread::yield();  // widen the window in which the lock is free
        });
        if (r % 10 == 9) dev.synchronize_stream(streams[i]);
      }
      dev.synchronize_stream(streams[i]);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(effects.load() == k_threads * 100);
  for (const stream_ref s : streams) CHECK(dev.stream_idle(s));
}
