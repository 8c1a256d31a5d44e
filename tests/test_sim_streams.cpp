// test_sim_streams: the simulated device's streams keep the promises of sim_device.hpp: copies and
// kernel effects happen when the op completes (in completion order), never at enqueue, and not on
// a held stream; copy timing is exactly latency + bytes / bandwidth, copies of one direction queue
// on their engine; events and stream_wait_event order streams (a wait sees the record made before
// it); run_until_idle and the synchronize calls move the clock exactly to the completions they
// wait for, and throw std::logic_error instead of hanging behind a held stream; kernel effects may
// call back into the device; the realtime clock completes work by itself; concurrent use from
// several threads stays consistent (run it under TSan).
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
#include "sim_test_helpers.hpp"

using namespace spillway;
using namespace spillway::sim_test;

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

TEST_CASE("copies: a source written while the copy runs is counted (a missing wait)") {
  sim_device dev(test_config());
  segment x(dev, 1000);
  std::memset(x.ptr, 0, 1000);
  std::vector<unsigned char> host(1000, 0);
  const stream_ref a = dev.create_stream(), b = dev.create_stream();
  SUBCASE("without a wait: the producer ends during the copy") {
    dev.launch(a, 50, [&] { std::memset(x.ptr, 7, 1000); });
    dev.copy_async(host.data(), x.ptr, 1000, copy_kind::device_to_host, b);  // no wait on a
    dev.synchronize_stream(b);
    CHECK(dev.counters().copy_sources_changed == 1);
  }
  SUBCASE("with the wait: the copy starts after the producer") {
    const event_ref done = dev.create_event();
    dev.launch(a, 50, [&] { std::memset(x.ptr, 7, 1000); });
    dev.record_event(done, a);
    dev.stream_wait_event(b, done);
    dev.copy_async(host.data(), x.ptr, 1000, copy_kind::device_to_host, b);
    dev.synchronize_stream(b);
    CHECK(dev.counters().copy_sources_changed == 0);
    CHECK(host[0] == 7);
  }
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

