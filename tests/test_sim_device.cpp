// test_sim_device: the simulated device's memory, faults and input checks keep the promises of
// sim_device.hpp: segments and mapped pages count against a fixed capacity and are real memory;
// VMM maps and unmaps at the granularity, rejects misuse naming the address, and accounts pages;
// pinned host memory has its own capacity; every fault site fails the Nth call; bad handles and
// pointers throw invalid_argument naming the value; counters count by kind.
// (Streams, events, copies, kernels and clocks: test_sim_streams.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "spillway/errors.hpp"
#include "spillway/sim_device.hpp"
#include "sim_test_helpers.hpp"

using namespace spillway;
using namespace spillway::sim_test;

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


TEST_CASE("segments: placement depends only on the reservations made, lowest address first") {
  // The allocator breaks best-fit ties by address; a replay is repeatable only if where a segment
  // lands does not depend on where the kernel puts an mmap (ASLR).
  const auto offsets = [] {
    sim_device dev(test_config());
    std::vector<std::uintptr_t> at;
    auto* a = static_cast<char*>(dev.reserve_segment(8 * k_mib));
    auto* b = static_cast<char*>(dev.reserve_segment(4 * k_mib + 100));
    auto* c = static_cast<char*>(dev.reserve_segment(6 * k_mib));
    REQUIRE((a != nullptr && b != nullptr && c != nullptr));
    CHECK(a < b);  // in the order asked for, not the kernel's top-down mmap order
    CHECK(b < c);
    std::memset(b, 0x5a, 4 * k_mib + 100);
    dev.release_segment(b, 4 * k_mib + 100);
    auto* d = static_cast<char*>(dev.reserve_segment(2 * k_mib));  // the lowest hole that fits
    auto* e = static_cast<char*>(dev.reserve_segment(2 * k_mib));
    auto* f = static_cast<char*>(dev.reserve_segment(3 * k_mib));  // too big for what is left of it
    REQUIRE((d != nullptr && e != nullptr && f != nullptr));
    CHECK(d == b);
    CHECK(e == b + 2 * k_mib);
    CHECK(f > c);
    CHECK(std::all_of(d, d + 2 * k_mib, [](char x) { return x == 0; }));  // fresh pages
    const auto base = reinterpret_cast<std::uintptr_t>(a);
    for (char* p : {a, d, e, c, f}) at.push_back(reinterpret_cast<std::uintptr_t>(p) - base);
    dev.release_segment(a, 8 * k_mib);
    dev.release_segment(c, 6 * k_mib);
    auto* g = static_cast<char*>(dev.reserve_segment(12 * k_mib));  // fits neither hole (8, 6 MiB)
    REQUIRE(g != nullptr);
    CHECK(g > f);
    at.push_back(reinterpret_cast<std::uintptr_t>(g) - base);
    return at;
  };
  const std::vector<std::uintptr_t> first = offsets();
  // A second device, made after other mappings moved the kernel's next mmap, places alike.
  std::vector<std::unique_ptr<char[]>> noise;
  for (int i = 0; i < 8; ++i) noise.emplace_back(new char[(i + 1) * 300 * 1024]);
  CHECK(offsets() == first);
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
  CHECK(dev.counters().invalid_releases == 0);
}

TEST_CASE("releasing what is not live changes nothing, costs nothing and is counted") {
  sim_config c = test_config();
  c.segment_reserve_latency_ns = 5000;
  c.page_map_latency_ns = 700;
  sim_device dev(c);
  void* p = dev.reserve_segment(k_mib);
  void* q = dev.reserve_segment(k_mib);
  REQUIRE(p != nullptr);
  REQUIRE(q != nullptr);
  dev.release_segment(p, k_mib);
  const std::uint64_t t = dev.now_ns();
  dev.release_segment(p, k_mib);                                 // twice
  dev.release_segment(static_cast<char*>(q) + 512, k_mib);       // inside a live one
  CHECK(dev.now_ns() == t);
  CHECK(dev.counters().invalid_releases == 2);
  CHECK(dev.counters().segments_released == 1);
  CHECK(dev.counters().used_bytes == k_mib);  // q is still there
  auto* base = static_cast<std::uint8_t*>(dev.reserve_address_range(4 * k_gran));
  REQUIRE(base != nullptr);
  dev.unmap_physical(base, k_gran);  // nothing mapped there: no driver time
  CHECK(dev.now_ns() == t);
  dev.release_address_range(base, 4 * k_gran);
  dev.release_address_range(base, 4 * k_gran);
  void* host = dev.allocate_pinned_host(4096);
  REQUIRE(host != nullptr);
  dev.free_pinned_host(host, 4096);
  dev.free_pinned_host(host, 4096);
  CHECK(dev.counters().invalid_releases == 4);
  dev.release_segment(q, k_mib);
}

TEST_CASE("vmm and sync: page_map_latency_ns and device_sync_latency_ns move the manual clock") {
  sim_config c = test_config();
  c.page_map_latency_ns = 700;
  c.device_sync_latency_ns = 3000;
  sim_device dev(c);
  auto* base = static_cast<std::uint8_t*>(dev.reserve_address_range(4 * k_gran));
  REQUIRE(base != nullptr);
  CHECK(dev.now_ns() == 0);  // address space is not a driver allocation here
  REQUIRE(dev.map_physical(base, 2 * k_gran));
  CHECK(dev.now_ns() == 700);  // one call, whatever its size
  dev.unmap_physical(base, 2 * k_gran);
  CHECK(dev.now_ns() == 1400);
  const stream_ref s = dev.create_stream();
  dev.launch(s, 10000);       // starts at 1,400
  dev.synchronize_device();  // drains the queue (11,400), then the bubble
  CHECK(dev.now_ns() == 14400);
  dev.release_address_range(base, 4 * k_gran);
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

  // Not whole granules: CUDA refuses it, so nothing changes; the call is counted.
  dev.unmap_physical(base + 3 * k_gran, k_gran / 2);
  dev.unmap_physical(base + 3 * k_gran + k_gran / 2, k_gran / 2);
  CHECK(dev.counters().misaligned_unmaps == 2);
  CHECK(dev.counters().used_bytes == 3 * k_gran);
  CHECK(std::memcmp(base + 3 * k_gran, want.data(), k_gran) == 0);

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
  CHECK(text.find(format_pointer(base + k_gran)) != std::string::npos);

  text = invalid_argument_text([&] { dev.map_physical(base + 512, k_gran); });
  CHECK(text.find(format_pointer(base + 512)) != std::string::npos);
  CHECK(text.find("granularity") != std::string::npos);
  text = invalid_argument_text([&] { dev.map_physical(base, k_gran / 2); });
  CHECK(text.find("32.00 KiB") != std::string::npos);
  text = invalid_argument_text([&] { dev.map_physical(base + 3 * k_gran, 2 * k_gran); });  // overruns
  CHECK(text.find("reserved address range") != std::string::npos);
  std::vector<std::uint8_t> host(2 * k_gran);
  auto* outside = reinterpret_cast<std::uint8_t*>(
      (reinterpret_cast<std::uintptr_t>(host.data()) + k_gran - 1) / k_gran * k_gran);
  text = invalid_argument_text([&] { dev.map_physical(outside, k_gran); });
  CHECK(text.find(format_pointer(outside)) != std::string::npos);

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

