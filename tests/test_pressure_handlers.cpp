// test_pressure_handlers: step 4 of Note [Memory pressure path]: the hook eviction uses. (Step 3,
// the release of free cache that covers the shortfall first: test_pressure_release.cpp.)
//
// It proves: when an allocation does not fit the budget, the handlers are called on the
// allocating thread, without the device lock (a handler may deallocate, and allocate and free, on
// the same allocator), with the request's fields (device, stream, bytes, pool, budget, reserved,
// shortfall); a handler that frees a victim lets the allocation succeed, also when its free waits
// on another stream's work (a spill's copy); a handler that frees nothing leads to the cache being
// released and then to out_of_memory reporting what the handler said was pinned; a throwing
// handler is reported through on_warning (delivered without the lock) and the next one still
// runs; a removed handler is not called; rounds go on while a handler frees allocations (past
// any small fixed number, and when another thread took what a round freed) and stop at the first
// that claims progress but frees none; free cache that does not cover the shortfall is kept while
// the handlers are asked; lowering the budget asks the handlers too; the counters count calls,
// retries and freed bytes.
// A deadlock would hang these tests: a watchdog aborts with a message instead.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "deadlock_watchdog.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// A 30 MiB budget with two live 12 MiB allocations on `s`: 24 MiB reserved. A third 12 MiB one
// does not fit until one of them is freed.
struct under_budget {
  std::unique_ptr<backend_env> env = make_sim_env();
  allocator_config config = make_config();
  device_allocator alloc{env->backend, config};
  stream_ref s = env->new_stream();
  void* a = alloc.allocate(12 * MiB, s);
  void* b = alloc.allocate(12 * MiB, s);

  allocator_config make_config() {
    allocator_config c = env->config();
    c.budget = 30 * MiB;
    return c;
  }
};

}  // namespace

TEST_CASE("a handler is called unlocked, with the request, and its victim serves the allocation") {
  under_budget u;
  pressure_request seen;
  int calls = 0;
  const auto caller = std::this_thread::get_id();
  bool same_thread = false;
  u.alloc.add_pressure_handler([&](const pressure_request& r) {
    ++calls;
    seen = r;
    same_thread = std::this_thread::get_id() == caller;
    // Calls back into the allocator: possible only because the lock is not held.
    void* t = u.alloc.allocate(512, u.s);
    u.alloc.deallocate(t);
    CHECK(u.alloc.stats().allocation[0].current == 2);
    const std::size_t freed = u.alloc.describe(u.a).size;
    CHECK(u.alloc.deallocate(u.a) == free_status::freed);
    return pressure_result{freed, 0};
  });

  void* c = nullptr;
  {
    deadlock_watchdog wd("a pressure handler calling back into the allocator");
    c = u.alloc.allocate(12 * MiB, u.s);
  }
  CHECK(calls == 1);
  CHECK(same_thread);
  CHECK(c == u.a);  // the victim's block, reused on its stream
  CHECK(seen.device == u.env->backend->device_index());
  CHECK(seen.stream == u.s);
  CHECK(seen.bytes == 12 * MiB);
  CHECK_FALSE(seen.small_pool);
  CHECK(seen.budget == 30 * MiB);
  CHECK(seen.reserved == 24 * MiB);
  // The smallest new segment for 12 MiB is 12 MiB: 24 + 12 - 30.
  CHECK(seen.shortfall == 6 * MiB);
  CHECK(seen.contiguous);  // fixed segments: 12 MiB in one range, or a segment given back
  const memory_stats st = u.alloc.stats();
  CHECK(st.num_pressure_handler_calls == 1);
  CHECK(st.num_alloc_retries == 1);
  CHECK(st.pressure_handler_freed_bytes == static_cast<std::int64_t>(12 * MiB));
  CHECK(st.num_ooms == 0);
  u.alloc.deallocate(c);
  u.alloc.deallocate(u.b);
  check_stats_match_snapshot(u.alloc.stats(), u.alloc.snapshot());
}

TEST_CASE("with expandable segments a request needs granules anywhere, not a contiguous range") {
  auto env = make_sim_env();
  const std::size_t g = env->backend->vmm_granularity();
  REQUIRE(g > 0);
  device_allocator alloc(env->backend, env->expandable_config(4 * g));
  void* a = alloc.allocate(g);
  void* b = alloc.allocate(g);
  void* d = alloc.allocate(2 * g);  // the budget is used up
  pressure_request seen;
  int calls = 0;
  alloc.add_pressure_handler([&](const pressure_request& r) {
    seen = r;
    ++calls;
    // Two victims that are not neighbours: their granules are unmapped and serve the request.
    alloc.deallocate(a);
    alloc.deallocate(d);
    return pressure_result{3 * g, 0};
  });
  // 1.5 granules: with fixed segments this would need a 20 MiB segment; here 2 granules.
  void* x = alloc.allocate(g + g / 2);
  CHECK(calls == 1);
  CHECK_FALSE(seen.contiguous);
  CHECK(seen.reserved == 4 * g);
  CHECK(seen.shortfall == 2 * g);
  CHECK(alloc.stats().reserved_bytes[0].current <= static_cast<std::int64_t>(4 * g));
  check_consistent(alloc);
  alloc.deallocate(x);
  alloc.deallocate(b);
}

TEST_CASE("free cache that does not cover the shortfall is kept while the handlers are asked") {
  under_budget u;
  void* small = u.alloc.allocate(4096, u.env->new_stream());
  u.alloc.deallocate(small);  // a cached 2 MiB segment: 26 MiB reserved, 6 MiB short for 12
  pressure_request seen;
  int calls = 0;
  u.alloc.add_pressure_handler([&](const pressure_request& r) {
    seen = r;
    ++calls;
    const std::size_t freed = u.alloc.describe(u.a).size;
    u.alloc.deallocate(u.a);  // its segment serves the request in place
    return pressure_result{freed, 0};
  });
  const memory_stats before = u.alloc.stats();
  void* c = u.alloc.allocate(12 * MiB, u.s);
  const memory_stats st = u.alloc.stats();
  CHECK(calls == 1);
  CHECK(seen.reserved == 26 * MiB);  // nothing was released before the handler
  CHECK(st.num_releases_before_eviction == before.num_releases_before_eviction);
  CHECK(st.num_sync_all_streams == before.num_sync_all_streams);  // served in place: no sync
  check_consistent(u.alloc);
  u.alloc.deallocate(c);
  u.alloc.deallocate(u.b);
}

TEST_CASE("a small-pool request under pressure names the small pool") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.budget = 2 * MiB;
  device_allocator alloc(env->backend, c);
  void* x = alloc.allocate(MiB);
  void* y = alloc.allocate(MiB);  // the one small segment is full
  pressure_request seen;
  alloc.add_pressure_handler([&](const pressure_request& r) {
    seen = r;
    alloc.deallocate(y);
    return pressure_result{MiB, 0};
  });
  void* z = alloc.allocate(4096);
  CHECK(z == y);
  CHECK(seen.small_pool);
  CHECK(seen.bytes == 4096);
  CHECK(seen.stream == stream_ref{});
  CHECK(seen.reserved == 2 * MiB);
  CHECK(seen.shortfall == 2 * MiB);  // a new small segment would be 2 MiB over
  alloc.deallocate(x);
  alloc.deallocate(z);
}

TEST_CASE("a handler that frees nothing: the cache is released, then out_of_memory names pinned") {
  under_budget u;
  void* small = u.alloc.allocate(4096, u.env->new_stream());
  u.alloc.deallocate(small);  // a cached 2 MiB segment: 26 MiB reserved
  int calls = 0;
  u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    return pressure_result{0, 7 * MiB};
  });
  const std::int64_t device_frees = u.alloc.stats().num_device_free;

  bool thrown = false;
  try {
    u.alloc.allocate(12 * MiB, u.s);
  } catch (const out_of_memory& e) {
    thrown = true;
    CHECK(e.info().pinned == 7 * MiB);
    const std::string what = e.what();
    INFO(what);
    CHECK(contains(what, format_bytes(7 * MiB) + " are pinned"));
    CHECK(e.info().reserved == 24 * MiB);  // the cached segment was released first
  }
  CHECK(thrown);
  CHECK(calls == 1);  // freed == 0: no second round
  const memory_stats st = u.alloc.stats();
  CHECK(st.num_pressure_handler_calls == 1);
  CHECK(st.num_device_free == device_frees + 1);
  CHECK(st.num_ooms == 1);
  CHECK(st.pressure_handler_freed_bytes == 0);
  CHECK(u.alloc.owns(u.a));
  CHECK(u.alloc.owns(u.b));
  u.alloc.deallocate(u.a);
  u.alloc.deallocate(u.b);
}

TEST_CASE("a throwing handler is reported, without the lock, and the next handler still runs") {
  auto env = make_sim_env();
  std::vector<std::string> warnings;
  std::atomic<device_allocator*> self{nullptr};
  allocator_config c;
  c.budget = 30 * MiB;
  c.on_warning = [&](const std::string& m) {
    warnings.push_back(m);
    // The sink calls back into the allocator: possible only if the lock is not held.
    if (device_allocator* a = self.load()) (void)a->stats();
  };
  device_allocator alloc(env->backend, c);
  self = &alloc;
  void* a = alloc.allocate(12 * MiB);
  void* b = alloc.allocate(12 * MiB);
  bool second_called = false;
  alloc.add_pressure_handler([](const pressure_request&) -> pressure_result {
    throw std::runtime_error("eviction engine exploded");
  });
  alloc.add_pressure_handler([&](const pressure_request&) {
    second_called = true;
    alloc.deallocate(a);
    return pressure_result{12 * MiB, 0};
  });
  void* x = nullptr;
  {
    deadlock_watchdog wd("on_warning calling back into the allocator");
    x = alloc.allocate(12 * MiB);
  }
  CHECK(x == a);
  CHECK(second_called);
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "pressure handler failed"));
  CHECK(contains(warnings[0], "eviction engine exploded"));
  self = nullptr;
  alloc.deallocate(x);
  alloc.deallocate(b);
}

TEST_CASE("while set_budget's handlers run, allocations are held to the new budget") {
  // The handlers run without the lock. An allocation meanwhile (here from inside the handler, as
  // another thread's could come) took the old budget's room back, and a budget the handler's
  // eviction alone would have met was refused.
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.budget = 100 * MiB;
  device_allocator alloc(env->backend, c);
  void* held = alloc.allocate(40 * MiB);
  void* meanwhile = nullptr;
  bool refused = false, inside = false;
  alloc.add_pressure_handler([&](const pressure_request&) -> pressure_result {
    if (inside || held == nullptr) return {};
    inside = true;
    try {
      meanwhile = alloc.allocate(35 * MiB);
    } catch (const out_of_memory&) {
      refused = true;
    }
    inside = false;
    alloc.deallocate(std::exchange(held, nullptr));
    return {40 * MiB, 0};
  });
  const budget_report r = alloc.set_budget(30 * MiB);
  CHECK(refused);
  CHECK(meanwhile == nullptr);
  CHECK(r.met());
  CHECK(alloc.budget() == 30 * MiB);

  // Refused in the end: the old budget is back.
  void* big = alloc.allocate(25 * MiB);
  CHECK_THROWS_AS(alloc.set_budget(10 * MiB), invalid_argument);
  CHECK(alloc.budget() == 30 * MiB);
  CHECK(alloc.stats().budget == static_cast<std::int64_t>(30 * MiB));
  alloc.deallocate(big);
}

TEST_CASE("a removed handler is not called") {
  under_budget u;
  int calls_a = 0, calls_b = 0;
  const pressure_handler_id ha = u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls_a;
    return pressure_result{};
  });
  const pressure_handler_id hb = u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls_b;
    return pressure_result{};
  });
  CHECK(ha != hb);
  u.alloc.remove_pressure_handler(ha);
  CHECK_THROWS_AS(u.alloc.allocate(12 * MiB, u.s), out_of_memory);
  CHECK(calls_a == 0);
  CHECK(calls_b == 1);
  u.alloc.remove_pressure_handler(hb);
  CHECK_THROWS_AS(u.alloc.allocate(12 * MiB, u.s), out_of_memory);
  CHECK(calls_b == 1);
  CHECK(u.alloc.stats().num_pressure_handler_calls == 1);
  CHECK(u.alloc.stats().num_alloc_retries == 2);
  u.alloc.deallocate(u.a);
  u.alloc.deallocate(u.b);
}

TEST_CASE("rounds stop when a handler claims progress but frees no allocation") {
  under_budget u;
  int calls = 0;
  u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    return pressure_result{4096, 0};  // claims a little, frees nothing
  });
  CHECK_THROWS_AS(u.alloc.allocate(12 * MiB, u.s), out_of_memory);
  CHECK(calls == 1);
  CHECK(u.alloc.stats().num_pressure_handler_calls == 1);
  CHECK(u.alloc.stats().pressure_handler_freed_bytes == 4096);
  u.alloc.deallocate(u.a);
  u.alloc.deallocate(u.b);
}

TEST_CASE("rounds go on while a handler frees memory, until a range fits") {
  // Two 20 MiB segments of ten 2 MiB blocks fill a 40 MiB budget. A 20 MiB request fits only in
  // a whole segment: the handler frees one block a round, in allocation order, so the first
  // segment is empty after ten rounds (more than any fixed small cap would allow).
  std::unique_ptr<backend_env> env = make_sim_env();
  allocator_config config = env->config();
  config.budget = 40 * MiB;
  device_allocator alloc{env->backend, config};
  std::vector<void*> blocks;
  for (int i = 0; i < 20; ++i) blocks.push_back(alloc.allocate(2 * MiB));
  REQUIRE(alloc.stats().reserved_bytes[0].current == static_cast<std::int64_t>(40 * MiB));
  std::size_t next = 0;
  alloc.add_pressure_handler([&](const pressure_request& r) {
    CHECK(r.bytes == 20 * MiB);
    if (next == blocks.size()) return pressure_result{0, 0};
    alloc.deallocate(blocks[next++]);
    return pressure_result{2 * MiB, 0};
  });
  void* big = alloc.allocate(20 * MiB);
  CHECK(next == 10);
  CHECK(alloc.stats().num_pressure_handler_calls == 10);
  CHECK(alloc.stats().reserved_bytes[0].current <= static_cast<std::int64_t>(40 * MiB));
  alloc.deallocate(big);
  for (std::size_t i = next; i < blocks.size(); ++i) alloc.deallocate(blocks[i]);
}

TEST_CASE("a round whose victim another thread took is followed by another round") {
  // The lock is released while the handler runs: another thread's allocation takes the block the
  // first round freed, so live bytes are what they were. The round still freed an allocation, and
  // the second victim must be asked for rather than the request failing.
  under_budget u;
  void* taken = nullptr;
  int calls = 0;
  u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    if (calls == 1) {
      u.alloc.deallocate(u.a);
      std::thread other([&] { taken = u.alloc.allocate(12 * MiB, u.s); });
      other.join();
      return pressure_result{12 * MiB, 0};
    }
    if (calls == 2) {
      u.alloc.deallocate(u.b);
      return pressure_result{12 * MiB, 0};
    }
    return pressure_result{0, 0};
  });
  void* p = nullptr;
  {
    deadlock_watchdog wd("a victim taken by another thread");
    p = u.alloc.allocate(12 * MiB, u.s);
  }
  CHECK(p != nullptr);
  CHECK(taken != nullptr);
  CHECK(calls == 2);
  u.alloc.deallocate(p);
  u.alloc.deallocate(taken);
  CHECK(u.alloc.stats().allocation[0].current == 0);
}

TEST_CASE("a handler's stream-ordered free (a spill) is awaited, then reused") {
  under_budget u;
  const stream_ref copy_stream = u.env->new_stream();
  bool copy_done = false;
  u.alloc.add_pressure_handler([&](const pressure_request& r) {
    // The victim is copied out on copy_stream, then freed in stream order after the copy.
    u.alloc.record_stream(u.a, copy_stream);
    u.env->sim->launch(copy_stream, 3'000'000, [&] { copy_done = true; });
    CHECK(u.alloc.deallocate(u.a) == free_status::deferred);
    return pressure_result{r.bytes, 0};
  });
  void* c = u.alloc.allocate(12 * MiB, u.s);
  CHECK(c == u.a);
  CHECK(copy_done);  // reused only after the copy completed
  u.alloc.deallocate(c);
  u.alloc.deallocate(u.b);
  check_stats_match_snapshot(u.alloc.stats(), u.alloc.snapshot());
}

TEST_CASE("lowering the budget asks the handlers, then releases what they freed") {
  under_budget u;
  pressure_request seen;
  u.alloc.add_pressure_handler([&](const pressure_request& r) {
    seen = r;
    u.alloc.deallocate(u.b);
    return pressure_result{12 * MiB, 0};
  });
  const budget_report r = u.alloc.set_budget(12 * MiB);
  CHECK(seen.bytes == 0);
  CHECK(seen.budget == 12 * MiB);
  CHECK(seen.reserved == 24 * MiB);
  CHECK(seen.shortfall == 12 * MiB);
  CHECK(r.met());
  CHECK(r.released == 12 * MiB);
  CHECK(r.reserved == 12 * MiB);
  CHECK(u.alloc.budget() == 12 * MiB);
  CHECK_FALSE(u.alloc.owns(u.b));
  u.alloc.deallocate(u.a);
}

TEST_CASE("lowering the budget asks every handler until the shortfall is freed") {
  under_budget u;
  int calls_first = 0, calls_second = 0;
  u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls_first;
    return pressure_result{0, 0};  // has nothing to give
  });
  u.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls_second;
    u.alloc.deallocate(u.b);
    return pressure_result{12 * MiB, 0};
  });
  const budget_report r = u.alloc.set_budget(12 * MiB);
  CHECK(calls_first == 1);
  CHECK(calls_second == 1);  // reached although the request's contiguous size is 0
  CHECK(r.met());
  CHECK(u.alloc.budget() == 12 * MiB);
  u.alloc.deallocate(u.a);
}

TEST_CASE("handlers run concurrently from several allocating threads") {
  // Each thread's allocation is under pressure; the handler evicts victims from a shared list.
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.budget = 64 * MiB;
  device_allocator alloc(env->backend, c);
  std::mutex victims_mutex;
  std::vector<void*> victims;
  for (int i = 0; i < 5; ++i) victims.push_back(alloc.allocate(12 * MiB));  // 60 MiB reserved
  std::atomic<int> calls{0};
  alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    void* v = nullptr;
    {
      std::lock_guard lock(victims_mutex);
      if (victims.empty()) return pressure_result{};
      v = victims.back();
      victims.pop_back();
    }
    alloc.deallocate(v);
    return pressure_result{12 * MiB, 0};
  });
  std::vector<void*> got(4, nullptr);
  {
    deadlock_watchdog wd("concurrent pressure handlers");
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        try {
          got[static_cast<std::size_t>(t)] = alloc.allocate(12 * MiB);
        } catch (const out_of_memory&) {
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  int served = 0;
  for (void* p : got) {
    if (p != nullptr) {
      ++served;
      alloc.deallocate(p);
    }
  }
  CHECK(served == 4);  // five victims are enough for four requests
  CHECK(calls.load() >= 1);
  for (void* v : victims) alloc.deallocate(v);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
  CHECK(alloc.stats().allocation[0].current == 0);
}

TEST_CASE("lowering the budget awaits every stream-ordered free the handlers scheduled") {
  under_budget u;
  u.alloc.set_budget(unlimited_budget);
  void* c = u.alloc.allocate(4 * MiB, u.s);  // a 20 MiB segment of its own: 44 MiB reserved
  const stream_ref copy_stream = u.env->new_stream();
  u.alloc.add_pressure_handler([&](const pressure_request&) {
    // Two victims spilled one after the other on the same copy stream.
    for (void* v : {u.a, u.b}) {
      u.alloc.record_stream(v, copy_stream);
      u.env->sim->launch(copy_stream, 2'000'000);
      CHECK(u.alloc.deallocate(v) == free_status::deferred);
    }
    return pressure_result{24 * MiB, 0};
  });
  const budget_report r = u.alloc.set_budget(20 * MiB);
  CHECK(r.met());
  CHECK(r.released == 24 * MiB);
  CHECK(r.reserved == 20 * MiB);
  CHECK(u.alloc.stats().active[0].current == 1);
  u.alloc.deallocate(c);
}

TEST_CASE("fits_without_eviction says whether an allocation is served without the pressure path") {
  under_budget t;  // 24 of 30 MiB reserved, both allocations live
  int calls = 0;
  t.alloc.add_pressure_handler([&](const pressure_request&) {
    ++calls;
    return pressure_result{};
  });
  stream_ref other = t.env->new_stream();
  CHECK(t.alloc.fits_without_eviction(0, t.s));
  CHECK(t.alloc.fits_without_eviction(6 * MiB, t.s));    // a new segment within the budget
  CHECK_FALSE(t.alloc.fits_without_eviction(12 * MiB, t.s));  // only by evicting
  t.alloc.deallocate(t.a);                                 // a cached 12 MiB block on s
  CHECK(t.alloc.fits_without_eviction(12 * MiB, t.s));
  CHECK_FALSE(t.alloc.fits_without_eviction(12 * MiB, other));  // not on another stream
  CHECK_FALSE(t.alloc.fits_without_eviction(size_classes::max_request_size + 1, t.s));
  CHECK(calls == 0);  // asking runs no handler
  CHECK(t.alloc.stats().num_alloc_retries == 0);
  t.alloc.deallocate(t.b);
}

TEST_CASE("fits_without_eviction needs the device to have the memory, whatever the budget") {
  // A 32 MiB device, no budget, 24 MiB live: another 12 MiB segment fits no budget but the
  // device has 8 MiB free; 6 MiB fits.
  sim_config sc = default_sim_config();
  sc.capacity = 32 * MiB;
  std::unique_ptr<backend_env> env = make_sim_env(sc);
  device_allocator alloc{env->backend, env->config()};
  stream_ref s = env->new_stream();
  void* a = alloc.allocate(12 * MiB, s);
  void* b = alloc.allocate(12 * MiB, s);
  CHECK_FALSE(alloc.fits_without_eviction(12 * MiB, s));
  CHECK(alloc.fits_without_eviction(6 * MiB, s));
  alloc.deallocate(a);
  alloc.deallocate(b);
}
