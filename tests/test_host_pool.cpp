// test_host_pool: the pinned host pool keeps the promises of host_pool.hpp, on a sim_device.
//
// It proves: sizes round to 4 KiB up to 2 MiB and to 2 MiB above; a freed block is reused (best
// fit, at most 25% larger) without a new backend allocation; the capacity caps what the pool
// holds (nullptr past it, cached blocks given back to make room); a failing backend makes the pool
// give back its cached blocks and retry once, and a second failure returns nullptr with the pool
// and the device agreeing on every byte; a block freed with free_after is not reused before its
// event completes (a held stream), is after, and the event is destroyed; unknown, interior, null
// and already freed pointers throw invalid_argument naming the pointer and change nothing; the
// destructor waits for pending events and gives everything back; threads that allocate, free and
// free_after at once on a realtime sim leave the pool and the device agreeing (run it under TSan).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "spillway/errors.hpp"
#include "spillway/eviction/host_pool.hpp"
#include "spillway/sim_device.hpp"

using namespace spillway;
using namespace spillway::eviction;

namespace {

constexpr std::size_t k_kib = 1024;
constexpr std::size_t k_mib = 1024 * k_kib;

sim_config test_config(std::size_t pinned_capacity = 256 * k_mib) {
  sim_config c;
  c.capacity = 64 * k_mib;
  c.pinned_host_capacity = pinned_capacity;
  c.clock = clock_mode::manual;
  c.h2d_bandwidth = 1e9;
  c.d2h_bandwidth = 1e9;
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

bool same(const host_pool_stats& a, const host_pool_stats& b) {
  return a.held_bytes == b.held_bytes && a.in_use_bytes == b.in_use_bytes &&
         a.peak_held_bytes == b.peak_held_bytes && a.backend_allocations == b.backend_allocations &&
         a.cache_hits == b.cache_hits && a.failed_allocations == b.failed_allocations;
}

}  // namespace

TEST_CASE("host_pool: rounding") {
  CHECK(host_pool::round_size(0) == 4 * k_kib);
  CHECK(host_pool::round_size(1) == 4 * k_kib);
  CHECK(host_pool::round_size(4 * k_kib) == 4 * k_kib);
  CHECK(host_pool::round_size(4 * k_kib + 1) == 8 * k_kib);
  CHECK(host_pool::round_size(1000 * k_kib) == 1000 * k_kib);
  CHECK(host_pool::round_size(2 * k_mib) == 2 * k_mib);
  CHECK(host_pool::round_size(2 * k_mib + 1) == 4 * k_mib);
  CHECK(host_pool::round_size(5 * k_mib) == 6 * k_mib);
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  CHECK(host_pool::round_size(max) == max);  // saturates: no pool can hold it
  CHECK(host_pool::round_size(max - 2 * k_mib) % (2 * k_mib) == 0);
}

TEST_CASE("host_pool: a freed block is reused without asking the backend") {
  sim_device sim(test_config());
  host_pool pool(sim, 64 * k_mib);

  void* a = pool.allocate(3 * k_mib);
  REQUIRE(a != nullptr);
  CHECK(pool.block_size(a) == 4 * k_mib);
  CHECK(sim.counters().pinned_used_bytes == 4 * k_mib);
  pool.free(a);
  CHECK(pool.stats().in_use_bytes == 0);
  CHECK(pool.stats().held_bytes == 4 * k_mib);

  for (int i = 0; i < 10; ++i) {  // a spill loop: no cudaHostAlloc per spill
    void* again = pool.allocate(4 * k_mib - 100);
    CHECK(again == a);
    pool.free(again);
  }
  host_pool_stats s = pool.stats();
  CHECK(s.backend_allocations == 1);
  CHECK(s.cache_hits == 10);
  CHECK(sim.counters().pinned_used_bytes == 4 * k_mib);

  SUBCASE("best fit, at most 25% larger") {
    void* big = pool.allocate(6 * k_mib);  // a second cached block, 6 MiB
    REQUIRE(big != nullptr);
    pool.free(big);
    CHECK(pool.allocate(5 * k_mib) == big);      // rounds to 6 MiB: exact
    pool.free(big);
    CHECK(pool.allocate(3500 * k_kib) == a);     // rounds to 4 MiB: the 4 MiB block, not 6
    pool.free(a);
    void* small = pool.allocate(2 * k_mib);      // 4 MiB would be 100% larger: a miss
    CHECK(small != a);
    CHECK(small != big);
    CHECK(pool.block_size(small) == 2 * k_mib);
    pool.free(small);
    CHECK(pool.stats().backend_allocations == 3);

    // The 25% bound, below 2 MiB where sizes are 4 KiB steps: a 1280 KiB block serves 1 MiB
    // (exactly 25% more) but not 1020 KiB (25.5% more).
    void* quarter = pool.allocate(1280 * k_kib);
    pool.free(quarter);
    void* miss = pool.allocate(1020 * k_kib);
    CHECK(miss != quarter);
    CHECK(pool.stats().backend_allocations == 5);
    CHECK(pool.allocate(k_mib) == quarter);
    CHECK(pool.stats().backend_allocations == 5);
    pool.free(quarter);
    pool.free(miss);
  }
  SUBCASE("release_cached gives the cached bytes back") {
    CHECK(pool.release_cached() == 4 * k_mib);
    CHECK(pool.stats().held_bytes == 0);
    CHECK(sim.counters().pinned_used_bytes == 0);
    CHECK(pool.release_cached() == 0);
  }
}

TEST_CASE("host_pool: the capacity caps what it holds") {
  sim_device sim(test_config());
  host_pool pool(sim, 8 * k_mib);

  void* a = pool.allocate(4 * k_mib);
  void* b = pool.allocate(4 * k_mib);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(pool.allocate(4 * k_kib) == nullptr);  // full: nothing cached to give back
  CHECK(pool.allocate(16 * k_mib) == nullptr); // over the capacity on its own
  host_pool_stats s = pool.stats();
  CHECK(s.failed_allocations == 2);
  CHECK(s.held_bytes == 8 * k_mib);
  CHECK(s.peak_held_bytes == 8 * k_mib);
  CHECK(sim.counters().pinned_used_bytes == 8 * k_mib);

  // A cached block too large to reuse for 1 MiB is given back to make room.
  pool.free(b);
  void* c = pool.allocate(k_mib);
  REQUIRE(c != nullptr);
  s = pool.stats();
  CHECK(s.held_bytes == 5 * k_mib);
  CHECK(s.in_use_bytes == 5 * k_mib);
  CHECK(sim.counters().pinned_used_bytes == 5 * k_mib);
  pool.free(a);
  pool.free(c);
}

TEST_CASE("host_pool: a backend failure releases the cached blocks and retries once") {
  SUBCASE("the retry succeeds") {
    sim_device sim(test_config());
    host_pool pool(sim, 64 * k_mib);
    void* cached1 = pool.allocate(2 * k_mib);
    void* cached2 = pool.allocate(8 * k_mib);
    void* kept = pool.allocate(k_mib);
    pool.free(cached1);
    pool.free(cached2);
    REQUIRE(pool.stats().held_bytes == 11 * k_mib);

    sim.fail_nth(fault_site::pinned_host_allocation, 1);
    void* p = pool.allocate(20 * k_mib);  // a miss: the first backend call fails
    REQUIRE(p != nullptr);
    CHECK(sim.counters().faults_injected == 1);
    const host_pool_stats s = pool.stats();
    CHECK(s.held_bytes == 21 * k_mib);  // the cached 10 MiB went back
    CHECK(s.in_use_bytes == 21 * k_mib);
    CHECK(s.backend_allocations == 4);
    CHECK(s.failed_allocations == 0);
    CHECK(sim.counters().pinned_used_bytes == 21 * k_mib);
    pool.free(p);
    pool.free(kept);
  }
  SUBCASE("nothing cached: no retry, nullptr, and the next call works") {
    sim_device sim(test_config());
    host_pool pool(sim, 64 * k_mib);
    void* kept = pool.allocate(k_mib);
    const host_pool_stats before = pool.stats();
    sim.fail_nth(fault_site::pinned_host_allocation, 1);
    CHECK(pool.allocate(k_mib) == nullptr);
    host_pool_stats s = pool.stats();
    CHECK(s.failed_allocations == before.failed_allocations + 1);
    s.failed_allocations = before.failed_allocations;
    CHECK(same(s, before));
    void* p = pool.allocate(k_mib);
    CHECK(p != nullptr);
    CHECK(sim.counters().pinned_used_bytes == 2 * k_mib);
    pool.free(p);
    pool.free(kept);
  }
  SUBCASE("the retry fails too: nullptr, and the pool and the device agree") {
    sim_device sim(test_config(8 * k_mib));  // the device has 8 MiB pinned in all
    host_pool pool(sim, 64 * k_mib);
    void* kept = pool.allocate(6 * k_mib);
    void* cached = pool.allocate(2 * k_mib);
    REQUIRE(kept != nullptr);
    REQUIRE(cached != nullptr);
    pool.free(cached);
    CHECK(pool.allocate(4 * k_mib) == nullptr);  // device full; after the release 2 MiB < 4 MiB
    host_pool_stats s = pool.stats();
    CHECK(s.failed_allocations == 1);
    CHECK(s.held_bytes == 6 * k_mib);
    CHECK(s.in_use_bytes == 6 * k_mib);
    CHECK(sim.counters().pinned_used_bytes == 6 * k_mib);
    CHECK(pool.block_size(kept) == 6 * k_mib);
    void* fits = pool.allocate(2 * k_mib);  // what the device has left still works
    CHECK(fits != nullptr);
    pool.free(fits);
    pool.free(kept);
    CHECK(pool.stats().in_use_bytes == 0);
  }
}

TEST_CASE("host_pool: free_after keeps the block until its event completes") {
  sim_device sim(test_config());
  host_pool pool(sim, 64 * k_mib);
  const stream_ref s = sim.create_stream();

  void* p = pool.allocate(k_mib);
  REQUIRE(p != nullptr);
  sim.hold(s);
  sim.launch(s, 1000);  // the "copy" that still reads p
  const event_ref e = sim.create_event();
  sim.record_event(e, s);
  pool.free_after(p, e);
  CHECK(pool.stats().in_use_bytes == k_mib);  // waiting counts as in use

  void* q = pool.allocate(k_mib);  // must not get p while the stream is held
  REQUIRE(q != nullptr);
  CHECK(q != p);
  CHECK(pool.stats().backend_allocations == 2);
  pool.free(q);
  CHECK_THROWS_AS(pool.free(p), spillway::invalid_argument);  // it was given back already

  sim.advance(1'000'000);  // time alone does not run a held stream
  void* r = pool.allocate(k_mib);
  CHECK(r == q);
  pool.free(r);

  sim.release(s);
  sim.run_until_idle();
  // The next call reaps: p is back in the cache, and the pool destroyed the event.
  void* again = pool.allocate(k_mib);
  void* again2 = pool.allocate(k_mib);
  CHECK((again == p || again2 == p));
  CHECK(pool.stats().backend_allocations == 2);
  CHECK(pool.stats().cache_hits == 3);
  CHECK_THROWS_AS(sim.event_completed(e), spillway::invalid_argument);
  pool.free(again);
  pool.free(again2);
  sim.destroy_stream(s);
}

TEST_CASE("host_pool: unknown pointers throw naming the pointer, and change nothing") {
  sim_device sim(test_config());
  host_pool pool(sim, 64 * k_mib);
  void* live = pool.allocate(64 * k_kib);
  void* freed = pool.allocate(64 * k_kib);
  pool.free(freed);
  int local = 0;
  char* interior = static_cast<char*>(live) + 16;
  const host_pool_stats before = pool.stats();
  const event_ref e = sim.create_event();

  for (void* bad : {static_cast<void*>(&local), freed, static_cast<void*>(interior),
                    static_cast<void*>(nullptr)}) {
    CAPTURE(format_pointer(bad));
    std::string m = invalid_argument_text([&] { pool.free(bad); });
    CHECK(m.find(format_pointer(bad)) != std::string::npos);
    CHECK(m.find("free") != std::string::npos);
    m = invalid_argument_text([&] { pool.free_after(bad, e); });
    CHECK(m.find(format_pointer(bad)) != std::string::npos);
    CHECK(m.find("free_after") != std::string::npos);
    m = invalid_argument_text([&] { (void)pool.block_size(bad); });
    CHECK(m.find(format_pointer(bad)) != std::string::npos);
    CHECK(same(pool.stats(), before));
  }
  CHECK(sim.event_completed(e));  // still the caller's (never recorded: complete)
  sim.destroy_event(e);
  CHECK(pool.block_size(live) == 64 * k_kib);
  pool.free(live);
}

TEST_CASE("host_pool: the destructor waits for pending events and gives everything back") {
  sim_device sim(test_config());
  const stream_ref s = sim.create_stream();
  event_ref e;
  {
    host_pool pool(sim, 64 * k_mib);
    void* pending = pool.allocate(2 * k_mib);
    void* cached = pool.allocate(4 * k_mib);
    void* still_out = pool.allocate(k_mib);
    REQUIRE(still_out != nullptr);
    pool.free(cached);
    sim.launch(s, 5000);
    e = sim.create_event();
    sim.record_event(e, s);
    pool.free_after(pending, e);
    CHECK_FALSE(sim.event_completed(e));
    CHECK(sim.counters().pinned_used_bytes == 7 * k_mib);
  }
  CHECK(sim.counters().pinned_used_bytes == 0);
  CHECK(sim.now_ns() >= 5000);  // it waited for the event
  CHECK_THROWS_AS(sim.event_completed(e), spillway::invalid_argument);  // and destroyed it
  sim.destroy_stream(s);
}

TEST_CASE("host_pool: concurrent allocate, free and free_after stay consistent") {
  sim_config config = test_config();
  config.clock = clock_mode::realtime;
  sim_device sim(config);
  host_pool pool(sim, 48 * k_mib);
  constexpr int threads = 4;
  constexpr int rounds = 400;
  std::vector<stream_ref> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(sim.create_stream());

  std::vector<std::thread> workers;
  std::vector<int> failures(threads, 0);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      std::vector<void*> held;
      for (int i = 0; i < rounds; ++i) {
        const std::size_t bytes = (rng() % 4096 + 1) * k_kib / 2;  // 512 B .. 2 MiB
        void* p = pool.allocate(bytes);
        if (p == nullptr) {
          ++failures[static_cast<std::size_t>(t)];
        } else {
          static_cast<char*>(p)[0] = 1;  // it is real memory
          held.push_back(p);
        }
        if (held.size() > 4 || (p == nullptr && !held.empty())) {
          void* victim = held.front();
          held.erase(held.begin());
          if (rng() % 2 == 0) {
            pool.free(victim);
          } else {
            sim.launch(streams[static_cast<std::size_t>(t)], 2000);
            const event_ref e = sim.create_event();
            sim.record_event(e, streams[static_cast<std::size_t>(t)]);
            pool.free_after(victim, e);
          }
        }
      }
      for (void* p : held) pool.free(p);
    });
  }
  for (std::thread& w : workers) w.join();
  sim.synchronize_device();
  pool.release_cached();  // reaps every pending block (its event is complete), then gives all back
  const host_pool_stats s = pool.stats();
  CHECK(s.in_use_bytes == 0);
  CHECK(s.held_bytes == 0);
  CHECK(s.peak_held_bytes <= 48 * k_mib);
  CHECK(sim.counters().pinned_used_bytes == 0);
  CHECK(s.cache_hits > 0);
  for (stream_ref st : streams) sim.destroy_stream(st);
}
