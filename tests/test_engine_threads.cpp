// test_engine_threads: the engine under concurrent use, on a sim device with a realtime clock
// (work completes by itself) and a budget that keeps it evicting. Built under ThreadSanitizer in CI
// (scripts/test.sh runs the tests matching 'thread').
//
// It proves: six threads that pin (on the buffer's stream or their own), unpin, evict, prefetch and
// query a shared graph of buffers with lineage, allocate over the budget through the allocator
// (so that the engine's pressure handler runs on their threads, while other threads hold the
// engine lock for restores and recomputes that call the handler back), and register, use and
// forget buffers and lineage nodes of their own, finish within a bounded time (a watchdog aborts
// on a deadlock) with every check kernel having seen the right bytes, pinned buffers never
// evicted, out_of_memory the only failure, and, once everything is forgotten, the allocator back
// to zero with a consistent snapshot. And that an engine destroyed while another thread's
// allocation is already in the allocator's pressure path (its handlers come from a snapshot taken
// before the engine unregistered) is not called after its destruction: the call frees nothing.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <latch>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "deadlock_watchdog.hpp"
#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

struct thread_counts {
  std::atomic<std::uint64_t> iterations{0}, pins{0}, ooms{0}, allocations{0}, registered{0},
      forgotten{0}, pinned_moved{0};
};

constexpr int k_threads = 6;
constexpr auto k_duration = std::chrono::milliseconds(1500);
constexpr int k_min_iterations = 300;  // per thread, however slow the machine (sanitizers)

}  // namespace

TEST_CASE("six threads pin, evict, allocate, register and forget under budget pressure") {
  deadlock_watchdog watchdog("test_engine_threads", std::chrono::seconds(240));
  engine_options o;
  o.clock = clock_mode::realtime;
  o.budget = 4 * MiB;  // a small segment per stream, ~5 MiB of shared buffers
  o.streams = 1;
  engine_env env(o);
  const std::vector<stream_ref> streams = {stream_ref{}, env.stream(0)};

  // The shared graph, built before the threads start and only read by them.
  lineage_graph shared(env);
  std::vector<buffer_id> ids;
  {
    std::mt19937_64 rng(7);
    for (int i = 0; i < 16; ++i) ids.push_back(shared.source(512 * (1 + rng() % 64), streams[i % 2]));
    while (ids.size() < 240) {
      const buffer_id a = ids[ids.size() - 1 - rng() % std::min<std::size_t>(6, ids.size())];
      const buffer_id b = ids[rng() % ids.size()];
      std::vector<std::size_t> outs{512 * (1 + rng() % 64)};
      if (rng() % 5 == 0) outs.push_back(512 * (1 + rng() % 16));
      const std::vector<buffer_id> made = shared.node(
          rng() % 2 == 0 ? std::vector<buffer_id>{a} : std::vector<buffer_id>{a, b}, outs,
          streams[rng() % 2], static_cast<double>(100 + rng() % 100'000));
      ids.insert(ids.end(), made.begin(), made.end());
    }
  }
  env.sim->synchronize_device();

  thread_counts counts;
  const auto deadline = std::chrono::steady_clock::now() + k_duration;
  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(t));
    lineage_graph own(env);  // this thread's buffers: registered, used and forgotten here
    std::vector<buffer_id> own_live;
    std::vector<pinned_buffer> held;
    auto pick = [&](const std::vector<buffer_id>& v) { return v[rng() % v.size()]; };
    for (int i = 0;; ++i) {
      if (i >= k_min_iterations && std::chrono::steady_clock::now() >= deadline) break;
      ++counts.iterations;
      const int op = static_cast<int>(rng() % 100);
      try {
        if (op < 30) {
          if (held.size() >= 3) held.erase(held.begin());
          const buffer_id id = pick(ids);
          const stream_ref use = streams[rng() % 2];
          pinned_buffer p = env.eng().pin(id, use);
          shared.check_kernel(id, p.get(), use, {}, 100 + rng() % 5000);
          held.push_back(std::move(p));
          ++counts.pins;
        } else if (op < 45) {
          if (!held.empty()) {
            // Still pinned: resident at the same pointer, whatever the others evicted meanwhile.
            pinned_buffer& p = held[rng() % held.size()];
            const buffer_state s = env.eng().state(p.id());
            if (s != buffer_state::resident && s != buffer_state::restoring) ++counts.pinned_moved;
            if (env.eng().pin(p.id()).get() != p.get()) ++counts.pinned_moved;
            held.erase(held.begin() + static_cast<std::ptrdiff_t>(rng() % held.size()));
          }
        } else if (op < 60) {
          const buffer_id id = pick(ids);
          const int m = static_cast<int>(rng() % 3);
          try {
            (void)env.eng().evict(id, m == 0 ? eviction_mode::spill
                                      : m == 1 ? eviction_mode::drop
                                               : eviction_mode::automatic);
          } catch (const invalid_argument&) {
            // pinned by some thread right now
          }
        } else if (op < 66) {
          env.eng().prefetch(pick(ids));
        } else if (op < 78) {
          const std::size_t bytes = rng() % 2 == 0 ? 512 * (1 + rng() % 64) : 64 * KiB * (1 + rng() % 8);
          const stream_ref s = streams[rng() % 2];
          void* p = env.alloc->allocate(bytes, s);
          env.sim->launch(s, 100, [p, bytes] { std::memset(p, 0x3C, bytes); });
          env.alloc->deallocate(p);
          ++counts.allocations;
        } else if (op < 88) {
          const stream_ref s = streams[rng() % 2];
          if (own_live.empty() || rng() % 3 == 0) {
            own_live.push_back(own.source(512 * (1 + rng() % 32), s));
          } else {
            const std::vector<buffer_id> made = own.node({pick(own_live)}, {512 * (1 + rng() % 32)}, s);
            own_live.push_back(made[0]);
          }
          ++counts.registered;
        } else if (op < 95) {
          if (!own_live.empty()) {
            const std::size_t k = rng() % own_live.size();
            bool is_held = false;
            for (const pinned_buffer& p : held) is_held = is_held || p.id() == own_live[k];
            if (!is_held) {
              env.eng().forget(own_live[k]);  // hidden if a node of ours still needs it
              own_live[k] = own_live.back();
              own_live.pop_back();
              ++counts.forgotten;
            }
          }
        } else {
          if (!own_live.empty()) own.expect(pick(own_live));
        }
      } catch (const out_of_memory&) {
        ++counts.ooms;
      }
    }
    held.clear();
    for (buffer_id id : own_live) {
      try {
        own.expect(id);
      } catch (const out_of_memory&) {
        ++counts.ooms;
      }
    }
    for (buffer_id id : own_live) env.eng().forget(id);
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) threads.emplace_back(worker, t);
  for (std::thread& t : threads) t.join();

  env.sim->synchronize_device();
  for (buffer_id id : ids) shared.expect(id);
  env.sim->synchronize_device();
  env.check_clean();
  const eviction::engine_stats st = env.eng().stats();
  MESSAGE("iterations " << counts.iterations.load() << ", pins " << counts.pins.load() << ", evictions "
                        << st.evictions << ", restores " << st.restores << ", recomputes "
                        << st.recomputes << ", ooms " << counts.ooms.load() << ", registered "
                        << counts.registered.load() << ", checks " << env.log.checks());
  CHECK(counts.iterations >= static_cast<std::uint64_t>(k_threads * k_min_iterations));
  CHECK(counts.pinned_moved == 0);
  CHECK(st.evictions > 0);
  CHECK(st.pressure_calls > 0);
  CHECK(st.pinned_bytes == 0);
  CHECK(st.registered == ids.size());
  CHECK(counts.ooms * 20 < counts.pins + counts.allocations + counts.registered);

  shared.forget_all();
  env.sim->synchronize_device();
  CHECK(env.eng().stats().registered == 0);
  CHECK(env.allocated_bytes() == 0);
  const memory_snapshot snap = env.alloc->snapshot();
  check_snapshot_invariants(snap);
  check_stats_match_snapshot(env.alloc->stats(), snap);
}

TEST_CASE("an engine destroyed while another thread's allocation is in the pressure path") {
  // A handler registered before the engine's holds the thread in the pressure path until the
  // engine is gone: the allocator then calls the engine's handler from its snapshot. Under ASan,
  // a call that reached the destroyed engine is a heap-use-after-free.
  auto sim = std::make_shared<sim_device>(sim_config{});
  allocator_config ac;
  ac.budget = 4 * MiB;
  device_allocator alloc(sim, ac);
  std::latch entered(1), go(1);
  std::atomic<int> first_handler_calls{0};
  alloc.add_pressure_handler([&](const pressure_request&) {
    if (first_handler_calls++ == 0) {
      entered.count_down();
      go.wait();
    }
    return pressure_result{};
  });
  auto engine = std::make_unique<eviction_engine>(alloc);
  void* p = alloc.allocate(2 * MiB);
  const buffer_id id = engine->register_buffer(p, 2 * MiB, {});  // something it could evict
  void* q = alloc.allocate(2 * MiB);
  std::exception_ptr error;
  std::thread t([&] {
    try {
      alloc.deallocate(alloc.allocate(2 * MiB));
    } catch (...) {
      error = std::current_exception();
    }
  });
  entered.wait();   // t's allocation is in the first handler; the engine's is in its snapshot
  engine.reset();   // unregisters, frees p
  go.count_down();  // t goes on to the engine's handler
  t.join();
  (void)id;
  // With p freed by the engine's destruction the budget has room: t's allocation either fits after
  // the handlers or fails for want of memory; the engine freed nothing.
  if (error) CHECK_THROWS_AS(std::rethrow_exception(error), out_of_memory);
  alloc.deallocate(q);
  CHECK(alloc.stats().allocation[0].current == 0);
}
