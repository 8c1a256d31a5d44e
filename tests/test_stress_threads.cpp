// test_stress_threads: many threads on many streams against one device allocator, on the sim
// device with a realtime clock (work completes by itself), under a budget that forces
// out_of_memory now and then. Built under ThreadSanitizer in CI.
//
// It proves: with 8 threads x 4 streams allocating random sizes, recording other streams (with
// kernels queued on them), handing allocations to other threads to free, changing the budget, and
// a pressure handler evicting handed-off allocations, no allocation is ever given to two owners
// (each carries an id pattern, checked by whoever frees it), every snapshot taken meanwhile tiles
// its segments, out_of_memory is the only failure and is counted exactly, and once everything is
// freed and the streams are drained the allocator is back to zero allocated, active and (after
// empty_cache) reserved bytes, with statistics that match its snapshot.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

struct owned {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  std::uint64_t id = 0;
};

struct stress_config {
  int threads = 8;
  int streams = 4;
  bool expandable = false;
  std::chrono::milliseconds duration{3000};
  int min_iterations = 400;      // per thread, however slow the machine (sanitizers)
  int max_iterations = 200'000;  // per thread; the duration usually ends the run first
};

struct stress_result {
  std::uint64_t allocations = 0;
  std::uint64_t ooms = 0;
  std::uint64_t deferred = 0;
  std::uint64_t evicted = 0;
};

stress_result run_stress(const stress_config& sc) {
  sim_config simc = default_sim_config();
  simc.clock = clock_mode::realtime;
  simc.capacity = 1024 * MiB;
  auto env = make_sim_env(simc);
  std::vector<stream_ref> streams;
  for (int i = 0; i < sc.streams; ++i) streams.push_back(env->new_stream());

  allocator_config config = env->config();
  config.budget = 256 * MiB;
  config.expandable_segments = sc.expandable;
  device_allocator alloc(env->backend, config);

  std::mutex handoff_mutex;
  std::deque<owned> handoff;  // allocations any thread may free
  std::atomic<std::uint64_t> next_id{0};
  std::atomic<std::uint64_t> allocations{0}, ooms{0}, deferred{0}, evicted{0}, corrupt{0};
  std::atomic<std::uint64_t> bad_snapshots{0}, unexpected{0};

  auto free_checked = [&](const owned& o) {
    if (!pattern_ok(o.ptr, o.bytes, o.id)) ++corrupt;
    const free_status st = alloc.deallocate(o.ptr);
    if (st == free_status::deferred) ++deferred;
    if (st != free_status::freed && st != free_status::deferred) ++unexpected;
  };

  // Eviction: free the oldest handed-off allocations until the request's bytes are covered.
  alloc.add_pressure_handler([&](const pressure_request& r) {
    pressure_result result;
    while (result.freed < r.bytes) {
      owned victim;
      {
        std::lock_guard lock(handoff_mutex);
        if (handoff.empty()) break;
        victim = handoff.front();
        handoff.pop_front();
      }
      result.freed += victim.bytes;
      free_checked(victim);
      ++evicted;
    }
    return result;
  });

  const auto deadline = std::chrono::steady_clock::now() + sc.duration;
  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(t));
    std::vector<owned> mine;
    for (int i = 0; i < sc.max_iterations; ++i) {
      if (i >= sc.min_iterations && std::chrono::steady_clock::now() >= deadline) break;
      int op = static_cast<int>(rng() % 100);
      if (op < 50 && mine.size() >= 96) op = 50;  // enough held: free instead
      const stream_ref s = streams[rng() % streams.size()];
      if (op < 50) {
        const int k = static_cast<int>(rng() % 100);
        const std::size_t n = k < 70 ? 1 + rng() % (64 * KiB)
                              : k < 95 ? 1 + rng() % MiB
                                       : MiB + rng() % (7 * MiB);
        try {
          owned o{alloc.allocate(n, s), n, ++next_id};
          fill_pattern(o.ptr, o.bytes, o.id);
          ++allocations;
          if (rng() % 3 == 0) {
            const stream_ref other = streams[rng() % streams.size()];
            alloc.record_stream(o.ptr, other);
            env->sim->launch(other, rng() % 50'000);
          }
          if (rng() % 4 == 0) {
            std::lock_guard lock(handoff_mutex);
            handoff.push_back(o);
          } else {
            mine.push_back(o);
          }
        } catch (const out_of_memory&) {
          ++ooms;
        }
      } else if (op < 80) {
        if (!mine.empty()) {
          const std::size_t k = rng() % mine.size();
          free_checked(mine[k]);
          mine[k] = mine.back();
          mine.pop_back();
        }
      } else if (op < 90) {
        owned o;
        {
          std::lock_guard lock(handoff_mutex);
          if (!handoff.empty()) {
            o = handoff.back();
            handoff.pop_back();
          }
        }
        if (o.ptr != nullptr) free_checked(o);
      } else if (op < 93) {
        env->sim->launch(s, rng() % 100'000);
      } else if (op < 95) {
        alloc.empty_cache();
      } else if (op < 97) {
        try {
          alloc.set_budget(192 * MiB + rng() % (128 * MiB));
        } catch (const spillway::invalid_argument&) {
          // below what live allocations hold right now: refused, as documented
        }
      } else {
        const memory_snapshot snap = alloc.snapshot();
        for (const segment_info& seg : snap.segments) {
          std::uintptr_t at = seg.address;
          bool previous_free = false;
          for (const block_info& b : seg.blocks) {
            if (b.address != at || (previous_free && !b.active())) ++bad_snapshots;
            previous_free = !b.active();
            at += b.size;
          }
          if (at != seg.address + seg.total_size) ++bad_snapshots;
        }
        (void)alloc.stats();
      }
    }
    for (const owned& o : mine) free_checked(o);
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < sc.threads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  for (const owned& o : handoff) free_checked(o);
  handoff.clear();

  // Everything is freed: drain the streams, reap, release.
  env->backend->synchronize_device();
  alloc.set_budget(unlimited_budget);
  alloc.empty_cache();

  const memory_stats st = alloc.stats();
  const memory_snapshot snap = alloc.snapshot();
  CHECK(corrupt.load() == 0);
  CHECK(bad_snapshots.load() == 0);
  CHECK(unexpected.load() == 0);
  CHECK(st.num_invalid_frees == 0);
  CHECK(st.num_ooms == static_cast<std::int64_t>(ooms.load()));
  CHECK(st.allocation[0].allocated == static_cast<std::int64_t>(allocations.load()));
  for (int i = 0; i < stat_type_count; ++i) {
    INFO("pool " << stat_type_name(i));
    CHECK(st.allocation[i].current == 0);
    CHECK(st.allocated_bytes[i].current == 0);
    CHECK(st.requested_bytes[i].current == 0);
    CHECK(st.active[i].current == 0);
    CHECK(st.active_bytes[i].current == 0);
    CHECK(st.reserved_bytes[i].current == 0);
    CHECK(st.segment[i].current == 0);
    CHECK(st.reserved_bytes[i].peak <= static_cast<std::int64_t>(320 * MiB));
  }
  CHECK(snap.segments.empty());
  check_stats_match_snapshot(st, snap);
  CHECK(env->warnings.size() == 0);
  return {allocations.load(), ooms.load(), deferred.load(), evicted.load()};
}

}  // namespace

TEST_CASE("stress: 8 threads x 4 streams under a budget") {
  const stress_result r = run_stress({});
  MESSAGE(r.allocations << " allocations, " << r.ooms << " out_of_memory, " << r.deferred
                        << " deferred frees, " << r.evicted << " evicted by the handler");
  CHECK(r.allocations > 500);
  CHECK(r.deferred > 0);
}

TEST_CASE("stress: expandable segments, 8 threads x 4 streams") {
  stress_config sc;
  sc.expandable = true;
  sc.duration = std::chrono::milliseconds(2000);
  const stress_result r = run_stress(sc);
  MESSAGE(r.allocations << " allocations, " << r.ooms << " out_of_memory, " << r.deferred
                        << " deferred frees, " << r.evicted << " evicted by the handler");
  CHECK(r.allocations > 500);
}
