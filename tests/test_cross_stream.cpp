// test_cross_stream: no block is reused before every stream that used it is past that use
// (Note [Cross-stream frees]), proven on the sim device with streams held back.
//
// It proves: a block freed after record_stream(other) is parked as pending and never handed out
// again, on its own stream or any other, while the other stream has not run the work queued
// before the free: not by the fast path, not by the slow path, not under budget pressure (which
// fails with out_of_memory instead), not by empty_cache; once the other stream runs, the next slow
// path reaps the block and reuses it. A kernel queued on the other stream that writes the block
// completes after the free without clobbering any later allocation. A free waits on every recorded
// stream, events of one stream are reaped in order, and deallocate says freed or deferred.
#include <doctest/doctest.h>

#include <cstring>
#include <stdexcept>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "forwarding_backend.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

block_state state_of(const device_allocator& alloc, const void* p) {
  const memory_snapshot snap = alloc.snapshot();
  const block_info* b = find_block(snap, p);
  REQUIRE(b != nullptr);
  return b->state;
}

bool inside(const void* p, const void* base, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const auto b = reinterpret_cast<std::uintptr_t>(base);
  return a >= b && a < b + bytes;
}

}  // namespace

TEST_CASE("deallocate says freed for own-stream blocks and deferred after record_stream") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();

  void* p = alloc.allocate(4096, a);
  CHECK(alloc.deallocate(p) == free_status::freed);

  p = alloc.allocate(4096, a);
  alloc.record_stream(p, a);  // its own stream: nothing to wait for
  CHECK(alloc.deallocate(p) == free_status::freed);

  p = alloc.allocate(4096, a);
  alloc.record_stream(p, b);
  alloc.record_stream(p, b);  // twice is once
  CHECK(alloc.deallocate(p) == free_status::deferred);
  env->sim->run_until_idle();
  alloc.empty_cache();
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
  CHECK(alloc.stats().active[0].current == 0);

  // The default stream counts as another stream too.
  p = alloc.allocate(4096, a);
  alloc.record_stream(p, stream_ref{});
  CHECK(alloc.deallocate(p) == free_status::deferred);
  env->sim->run_until_idle();
  alloc.empty_cache();
  CHECK(alloc.stats().active[0].current == 0);
}

TEST_CASE("deallocate says freed when no event could be recorded and the streams were waited for") {
  struct no_events final : forwarding_backend {
    using forwarding_backend::forwarding_backend;
    void before(backend_call c) override {
      if (c == backend_call::record_event) throw device_error("injected: no event");
    }
  };
  auto env = make_sim_env();
  auto backend = std::make_shared<no_events>(env->backend);
  device_allocator alloc(backend, env->config());
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();
  void* p = alloc.allocate(4096, a);
  alloc.record_stream(p, b);
  CHECK(alloc.deallocate(p) == free_status::freed);  // b was waited for: nothing is pending
  CHECK(state_of(alloc, p) == block_state::inactive);
  CHECK(alloc.allocate(4096, a) == p);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("a block is not reused while a held stream that used it has not run") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();
  const std::size_t size = 12 * MiB;  // a segment of its own: only x can serve x's size there

  void* x = alloc.allocate(size, a);
  alloc.record_stream(x, b);
  env->sim->hold(b);
  env->sim->launch(b, 1000);  // b's use of x, stuck behind the hold
  CHECK(alloc.deallocate(x) == free_status::deferred);
  CHECK(state_of(alloc, x) == block_state::active_pending_free);
  CHECK_FALSE(alloc.owns(x));

  // The slow path (reap, reserve) runs for every one of these: none may get x.
  std::vector<void*> held;
  for (int i = 0; i < 8; ++i) {
    void* y = alloc.allocate(size, a);
    CHECK(y != x);
    held.push_back(y);
    env->sim->advance(1'000'000);  // time passes; b stays held
  }
  // Under budget pressure: awaiting b is impossible while it is held, so out_of_memory.
  {
    const auto reserved = static_cast<std::size_t>(alloc.stats().reserved_bytes[0].current);
    scoped_budget tight(alloc, reserved);
    CHECK_THROWS_AS(alloc.allocate(size, a), out_of_memory);
    CHECK(state_of(alloc, x) == block_state::active_pending_free);
  }
  // Smaller requests on a, and requests on b and on the default stream, stay out of x too. They
  // stay live, so that no free block on a could serve `size` below.
  for (stream_ref s : {a, b, stream_ref{}}) {
    for (std::size_t n : {std::size_t{4096}, 2 * MiB, 11 * MiB}) {
      void* y = alloc.allocate(n, s);
      CHECK_FALSE(inside(y, x, size));
      held.push_back(y);
    }
  }
  // empty_cache cannot release while b blocks the device synchronisation (reported); x stays
  // pending.
  void* spare = alloc.allocate(4096, env->new_stream());
  alloc.deallocate(spare);  // a fully free segment, so that empty_cache has something to release
  env->warnings.clear();
  alloc.empty_cache();
  CHECK(state_of(alloc, x) == block_state::active_pending_free);
  const auto warnings = env->warnings.messages();
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "cached memory kept"));
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());

  // b runs: the next slow path reaps x and hands it out again.
  env->sim->release(b);
  env->sim->run_until_idle();
  void* again = alloc.allocate(size, a);
  CHECK(again == x);
  CHECK(alloc.stats().active[0].current == static_cast<std::int64_t>(held.size()) + 1);
  alloc.deallocate(again);
  for (void* y : held) alloc.deallocate(y);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("a kernel on the other stream writing after the free clobbers no later allocation") {
  for (bool use_hold : {true, false}) {
    CAPTURE(use_hold);
    auto env = make_sim_env();
    device_allocator alloc(env->backend, env->config());
    const stream_ref a = env->new_stream();
    const stream_ref b = env->new_stream();
    const std::size_t size = 256 * KiB;

    void* x = alloc.allocate(size, a);
    alloc.record_stream(x, b);
    if (use_hold) env->sim->hold(b);
    // b's kernel writes x when it completes: 1 ms from now, or after release(b).
    env->sim->launch(b, 1'000'000, [x, size] { std::memset(x, 0xEE, size); });
    CHECK(alloc.deallocate(x) == free_status::deferred);

    // Allocations on a (cache hits and fresh segments) get patterns the kernel must not touch.
    std::vector<std::pair<void*, std::uint64_t>> later;
    for (std::uint64_t id = 1; id <= 40; ++id) {
      void* y = alloc.allocate(size, a);
      CHECK(y != x);
      fill_pattern(y, size, id);
      later.emplace_back(y, id);
      if (id % 10 == 0) {  // free a few and allocate again: reuse, but never of x
        alloc.deallocate(later.front().first);
        later.erase(later.begin());
      }
    }
    if (use_hold) {
      env->sim->advance(10'000'000);
      CHECK_FALSE(env->sim->stream_idle(b));
      env->sim->release(b);
    }
    env->sim->run_until_idle();  // the kernel writes x now

    for (auto [y, id] : later) {
      std::size_t bad = 0;
      CHECK_MESSAGE(pattern_ok(y, size, id, &bad), "allocation " << id << " clobbered at " << bad);
    }
    // The kernel did write, after the free: x holds its bytes.
    const auto* bytes = static_cast<const unsigned char*>(x);
    CHECK(bytes[0] == 0xEE);
    CHECK(bytes[size - 1] == 0xEE);

    for (auto [y, id] : later) alloc.deallocate(y);
    alloc.empty_cache();
    CHECK(alloc.stats().active[0].current == 0);
    check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
  }
}

TEST_CASE("a free waits for every stream it was recorded on") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();
  const stream_ref c = env->new_stream();

  void* x = alloc.allocate(12 * MiB, a);
  alloc.record_stream(x, b);
  alloc.record_stream(x, c);
  env->sim->hold(b);
  env->sim->hold(c);
  env->sim->launch(b, 100);
  env->sim->launch(c, 100);
  CHECK(alloc.deallocate(x) == free_status::deferred);

  env->sim->release(c);
  env->sim->advance(1'000'000);  // c done, b still held
  alloc.empty_cache();           // reaps what completed: c's event
  CHECK(state_of(alloc, x) == block_state::active_pending_free);
  void* y = alloc.allocate(12 * MiB, a);
  CHECK(y != x);

  env->sim->release(b);
  env->sim->run_until_idle();
  void* z = alloc.allocate(12 * MiB, a);  // y is live: the slow path reaps x
  CHECK(z == x);
  alloc.deallocate(y);
  alloc.deallocate(z);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("frees recorded on one stream are reaped in that stream's order") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();

  void* x1 = alloc.allocate(12 * MiB, a);
  void* x2 = alloc.allocate(12 * MiB, a);
  alloc.record_stream(x1, b);
  alloc.record_stream(x2, b);
  env->sim->launch(b, 1'000);          // b's use of x1
  alloc.deallocate(x1);                // event 1 on b, after 1 us of work
  env->sim->launch(b, 5'000'000);      // b's use of x2: 5 ms
  alloc.deallocate(x2);                // event 2 on b, after 5 ms more

  env->sim->advance(100'000);          // past x1's use, not x2's
  void* r1 = alloc.allocate(12 * MiB, a);  // the slow path reaps x1 only, and reuses it
  CHECK(r1 == x1);
  CHECK(state_of(alloc, x2) == block_state::active_pending_free);

  env->sim->advance(10'000'000);
  void* r2 = alloc.allocate(12 * MiB, a);
  CHECK(r2 == x2);
  alloc.deallocate(r1);
  alloc.deallocate(r2);
  CHECK(alloc.stats().active[0].current == 0);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("under budget pressure a pending free is awaited instead of failing") {
  auto env = make_sim_env();
  allocator_config c = env->config();
  c.budget = 12 * MiB;
  device_allocator alloc(env->backend, c);
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();

  void* x = alloc.allocate(12 * MiB, a);
  alloc.record_stream(x, b);
  bool kernel_done = false;
  env->sim->launch(b, 5'000'000, [&kernel_done] { kernel_done = true; });
  CHECK(alloc.deallocate(x) == free_status::deferred);

  // Nothing is allocated; the only memory is x, waiting on b. The allocator waits for b (the
  // simulation runs to the event) rather than report 12 MiB missing.
  void* y = alloc.allocate(12 * MiB, a);
  CHECK(y == x);
  CHECK(kernel_done);  // the wait happened before the reuse
  CHECK(alloc.stats().num_ooms == 0);
  alloc.deallocate(y);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("empty_cache waits for frees pending on other streams, then releases everything") {
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->config());
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();

  void* x = alloc.allocate(12 * MiB, a);
  void* y = alloc.allocate(4096, a);
  alloc.record_stream(x, b);
  alloc.record_stream(y, b);
  env->sim->launch(b, 2'000'000);  // b still uses x and y for 2 ms
  CHECK(alloc.deallocate(x) == free_status::deferred);
  CHECK(alloc.deallocate(y) == free_status::deferred);

  // Nothing is live: empty_cache gives everything back, after b is past its use.
  CHECK(alloc.empty_cache() == 12 * MiB + 2 * MiB);
  CHECK(env->sim->stream_idle(b));
  const memory_stats st = alloc.stats();
  CHECK(st.reserved_bytes[0].current == 0);
  CHECK(st.active[0].current == 0);
  CHECK(alloc.snapshot().segments.empty());

  // With b held the wait is impossible: the pending block stays, nothing is released early.
  void* z = alloc.allocate(12 * MiB, a);
  alloc.record_stream(z, b);
  env->sim->hold(b);
  env->sim->launch(b, 1000);
  CHECK(alloc.deallocate(z) == free_status::deferred);
  CHECK(alloc.empty_cache() == 0);
  CHECK(state_of(alloc, z) == block_state::active_pending_free);
  env->sim->release(b);
  CHECK(alloc.empty_cache() == 12 * MiB);
  CHECK(alloc.snapshot().segments.empty());
}

TEST_CASE("on_free_completed: at once for own-stream frees, after the other streams for deferred ones") {
  auto env = make_sim_env();
  struct completion {
    void* ptr;
    std::size_t requested;
    stream_ref stream;
  };
  std::vector<completion> completed;
  allocator_config config = env->config();
  config.on_free_completed = [&](void* ptr, std::size_t requested, stream_ref stream) {
    completed.push_back({ptr, requested, stream});
  };
  device_allocator alloc(env->backend, config);
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();

  void* p = alloc.allocate(5000, a);
  CHECK(completed.empty());
  CHECK(alloc.deallocate(p) == free_status::freed);
  REQUIRE(completed.size() == 1);
  CHECK(completed[0].ptr == p);
  CHECK(completed[0].requested == 5000);  // what was asked for, not the rounded block
  CHECK(completed[0].stream == a);

  void* x = alloc.allocate(12 * MiB, a);
  alloc.record_stream(x, b);
  env->sim->hold(b);
  env->sim->launch(b, 1000);  // b's use of x, stuck behind the hold
  CHECK(alloc.deallocate(x) == free_status::deferred);
  void* y = alloc.allocate(12 * MiB, a);  // the slow path reaps: x's event has not completed
  CHECK(completed.size() == 1);
  env->sim->release(b);
  env->sim->run_until_idle();
  CHECK(completed.size() == 1);  // nothing reaped yet: no call has looked
  alloc.empty_cache();           // reaps x's event, then releases what is free
  REQUIRE(completed.size() == 2);
  CHECK(completed[1].ptr == x);
  CHECK(completed[1].requested == 12 * MiB);
  CHECK(completed[1].stream == a);

  // A throwing observer changes nothing: the block is freed all the same.
  alloc.deallocate(y);
  config.on_free_completed = [](void*, std::size_t, stream_ref) { throw std::runtime_error("no"); };
  device_allocator other(env->backend, config);
  void* z = other.allocate(4096, a);
  CHECK(other.deallocate(z) == free_status::freed);
  CHECK(other.stats().allocated_bytes[0].current == 0);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("under pressure, frees pending on streams that can be waited for are reaped when another cannot") {
  // Two frees pending, on a stream whose work is merely unfinished and on a held one: the wait
  // for the held one fails, and the other's free must still serve the request.
  auto env = make_sim_env();
  allocator_config config = env->config();
  config.budget = 24 * MiB;
  device_allocator alloc(env->backend, config);
  const stream_ref s = env->new_stream();
  const stream_ref a = env->new_stream();
  const stream_ref b = env->new_stream();
  void* x = alloc.allocate(12 * MiB, s);
  void* y = alloc.allocate(12 * MiB, s);  // the budget is full
  alloc.record_stream(x, a);
  env->sim->launch(a, 5'000'000);  // a uses x for 5 ms (the clock is manual: not done yet)
  alloc.record_stream(y, b);
  env->sim->hold(b);
  env->sim->launch(b, 1000);
  CHECK(alloc.deallocate(x) == free_status::deferred);
  CHECK(alloc.deallocate(y) == free_status::deferred);
  void* z = alloc.allocate(12 * MiB, s);  // waits for a, not for b
  CHECK(z == x);
  CHECK(state_of(alloc, y) == block_state::active_pending_free);
  alloc.deallocate(z);
  env->sim->release(b);
  env->sim->run_until_idle();
  alloc.empty_cache();
  CHECK(alloc.stats().reserved_bytes[0].current == 0);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}

TEST_CASE("expandable segments: an awaited free that joins the free tail lets it grow within the budget") {
  // [x 2.5 MiB][p 1.17 MiB][free] in 4 MiB of granules; p's free waits on another stream. With
  // p back, the tail is free from 2.5 MiB on, and 3 MiB needs one more granule, which the budget
  // allows: served, not out of memory.
  auto env = make_sim_env();
  device_allocator alloc(env->backend, env->expandable_config(unlimited_budget));
  const stream_ref s = env->new_stream();
  const stream_ref t = env->new_stream();
  void* x = alloc.allocate(2 * MiB + 512 * KiB, s);
  void* p = alloc.allocate(1200 * KiB, s);
  alloc.record_stream(p, t);
  env->sim->launch(t, 1'000'000);  // t still uses p for 1 ms
  CHECK(alloc.deallocate(p) == free_status::deferred);
  alloc.set_budget(6 * MiB);
  void* z = alloc.allocate(3 * MiB, s);
  CHECK(z != nullptr);
  CHECK(alloc.stats().reserved_bytes[0].current <= static_cast<std::int64_t>(6 * MiB));
  CHECK(alloc.stats().num_ooms == 0);
  alloc.deallocate(z);
  alloc.deallocate(x);
  check_stats_match_snapshot(alloc.stats(), alloc.snapshot());
}
