// test_engine_misuse: every misuse of the engine's API is a clear error, and changes nothing.
//
// It proves: unpin without a pin or of a pin a guard holds, an unknown id, an id used after forget (also once its slot was
// reused by a newer buffer), forget or evict while pinned, registering a pointer the allocator
// does not own (a host pointer, null, an interior pointer, a freed one), a double registration, a
// size of 0 or larger than the allocation, a stream the device does not know, add_node with an empty compute, no outputs, a cost that
// is NaN, infinite or negative, or an unknown or forgotten input, an output_index out of range, an
// output slot already taken or registered with another size, an unknown or retired producer, a
// producer that reads the buffer itself (set_lineage), a
// bad engine_config and a second engine on one allocator are each reported with
// spillway::invalid_argument whose message names the id, pointer, node or value; and that after
// each one the engine's statistics, every buffer's state and bytes, and the allocator's statistics
// are what they were. Also: an engine destroyed with a pin outstanding says what is pinned and
// aborts (in a child process), and a clock that throws leaves no pin behind.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "forwarding_backend.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

std::string id_text(buffer_id id) {
  return "buffer " + std::to_string(id.value & 0xffffffffu) + "#" + std::to_string(id.value >> 32);
}

// A small graph, and a snapshot of everything a refused call must leave as it was.
struct fixture {
  engine_env env;
  lineage_graph g{env};
  buffer_id s, a, b;
  node_id n;

  fixture() {
    s = g.source(8 * KiB);
    a = g.node({s}, {8 * KiB})[0];
    n = g.nodes().back().id;
    b = g.node({a}, {4 * KiB})[0];
    env.sim->run_until_idle();
    REQUIRE(env.eng().evict(b, eviction_mode::drop));
  }

  struct state_snapshot {
    eviction::engine_stats engine;
    memory_stats alloc;
    std::vector<buffer_state> states;
  };
  state_snapshot take() const {
    state_snapshot t{env.eng().stats(), env.alloc->stats(), {}};
    for (const auto& r : g.buffers()) t.states.push_back(env.eng().state(r.id));
    return t;
  }
  void check_unchanged(const state_snapshot& before) const {
    const state_snapshot after = take();
    CHECK(after.engine.registered == before.engine.registered);
    CHECK(after.engine.resident_bytes == before.engine.resident_bytes);
    CHECK(after.engine.pinned_bytes == before.engine.pinned_bytes);
    CHECK(after.engine.evictions == before.engine.evictions);
    CHECK(after.engine.recomputes == before.engine.recomputes);
    CHECK(after.engine.restores == before.engine.restores);
    check_same_stats(before.alloc, after.alloc);
    CHECK(after.states == before.states);
  }
  void check_bytes() {
    for (const auto& r : g.buffers()) g.expect(r.id);
    env.sim->run_until_idle();
    env.check_clean();
  }
};

// Runs `call`, which must throw spillway::invalid_argument mentioning every part, and checks that
// nothing changed.
template <class F>
void refused(fixture& f, F&& call, const std::vector<std::string>& parts) {
  const auto before = f.take();
  try {
    call();
    FAIL("the call was accepted");
  } catch (const invalid_argument& e) {
    for (const std::string& part : parts) CHECK_MESSAGE(contains(e.what(), part), std::string(e.what()) << " lacks '" << part << "'");
  }
  f.check_unchanged(before);
}

}  // namespace

TEST_CASE("pins: unpin without a pin, forget or evict while pinned") {
  fixture f;
  eviction_engine& e = f.env.eng();
  refused(f, [&] { e.unpin(f.a); }, {id_text(f.a), "not pinned"});
  {
    pinned_buffer p = e.pin(f.a);
    refused(f, [&] { e.forget(f.a); }, {id_text(f.a), "pinned"});
    refused(f, [&] { e.evict(f.a); }, {id_text(f.a), "pinned"});
    refused(f, [&] { e.evict(f.a, eviction_mode::drop); }, {id_text(f.a), "pinned"});
    CHECK(e.state(f.a) == buffer_state::resident);
  }
  // A pin released from its guard is unpinned by hand; one unpin too many is refused again.
  (void)e.pin(f.s).get();  // the guard unpins at once
  auto p = e.pin(f.s);
  CHECK(p.release() == f.s);
  CHECK_FALSE(p);
  CHECK(p.release() == buffer_id{});  // an empty guard has nothing to release
  refused(f, [&] { e.evict(f.s); }, {id_text(f.s), "pinned"});
  e.unpin(f.s);
  refused(f, [&] { e.unpin(f.s); }, {id_text(f.s), "not pinned"});
  f.check_bytes();
}

TEST_CASE("pins: unpin of a pin that a guard holds is refused, and the guard still holds it") {
  fixture f;
  eviction_engine& e = f.env.eng();
  pinned_buffer guard = e.pin(f.a);
  refused(f, [&] { e.unpin(f.a); }, {id_text(f.a), "pinned_buffer guard", "release()"});
  // Still pinned by the guard: not evicted, not moved.
  refused(f, [&] { e.evict(f.a); }, {id_text(f.a), "pinned"});
  CHECK(e.state(f.a) == buffer_state::resident);
  // A released pin beside a guard's: unpin gives back the released one only, once.
  pinned_buffer second = e.pin(f.a);
  (void)second.release();
  e.unpin(f.a);
  refused(f, [&] { e.unpin(f.a); }, {id_text(f.a), "pinned_buffer guard"});
  refused(f, [&] { e.evict(f.a); }, {id_text(f.a), "pinned"});
  guard.reset();
  CHECK(e.evict(f.a));
  f.check_bytes();
}

TEST_CASE("pin(id, use) with a stream the device does not know: refused, not left pinned") {
  fixture f;
  eviction_engine& e = f.env.eng();
  const stream_ref bogus{999};
  const auto before = f.take();
  CHECK_THROWS_WITH_AS((void)e.pin(f.a, bogus), doctest::Contains("999"), invalid_argument);
  f.check_unchanged(before);
  f.check_bytes();
}

TEST_CASE("ids: unknown, zero, forgotten, and forgotten with the slot reused") {
  fixture f;
  eviction_engine& e = f.env.eng();
  const buffer_id unknown{12345};
  const buffer_id zero{};
  for (buffer_id id : {unknown, zero}) {
    refused(f, [&] { (void)e.pin(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { e.unpin(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { e.forget(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { e.evict(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { e.prefetch(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { (void)e.state(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { (void)e.size(id); }, {id_text(id), "no such buffer"});
    refused(f, [&] { e.set_lineage(id, f.n); }, {id_text(id), "no such buffer"});
  }

  // A forgotten buffer: every call names it as forgotten, also after its slot was reused.
  const buffer_id gone = e.register_buffer(f.env.alloc->allocate(4 * KiB), 4 * KiB, {});
  e.forget(gone);
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    refused(f, [&] { (void)e.pin(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { e.unpin(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { e.forget(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { e.evict(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { e.prefetch(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { (void)e.state(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { (void)e.size(gone); }, {id_text(gone), "forgotten"});
    refused(f, [&] { (void)e.add_node({.name = "late", .inputs = {gone}, .compute = [](auto, auto, auto) {}}); },
            {id_text(gone), "forgotten"});
    if (round == 0) {
      void* p = f.env.alloc->allocate(4 * KiB);
      const buffer_id newer = e.register_buffer(p, 4 * KiB, {});
      CHECK((newer.value & 0xffffffffu) == (gone.value & 0xffffffffu));  // the slot, reused
      CHECK(newer != gone);
      CHECK(e.state(newer) == buffer_state::resident);
      e.forget(newer);
    }
  }
  f.check_bytes();
}

TEST_CASE("register_buffer: pointers the allocator does not own, sizes, double registration") {
  fixture f;
  eviction_engine& e = f.env.eng();
  int host_object = 0;
  void* live = f.env.alloc->allocate(8 * KiB);
  void* freed = f.env.alloc->allocate(8 * KiB);
  f.env.alloc->deallocate(freed);
  void* interior = static_cast<char*>(live) + 512;
  for (void* p : {static_cast<void*>(&host_object), static_cast<void*>(nullptr), interior, freed}) {
    CAPTURE(format_pointer(p));
    refused(f, [&] { (void)e.register_buffer(p, 512, {}); }, {format_pointer(p), "not a live allocation"});
  }
  refused(f, [&] { (void)e.register_buffer(live, 0, {}); }, {format_pointer(live), "0 bytes", "8192"});
  refused(f, [&] { (void)e.register_buffer(live, 8 * KiB + 1, {}); },
          {format_pointer(live), "8193 bytes", "8192"});
  const buffer_id id = e.register_buffer(live, 8 * KiB, {});
  refused(f, [&] { (void)e.register_buffer(live, 8 * KiB, {}); }, {format_pointer(live), "already", id_text(id)});
  // A pointer the engine owns (a resident registered buffer) is not the user's to register.
  void* owned = e.pin(f.a).get();
  refused(f, [&] { (void)e.register_buffer(owned, 8 * KiB, {}); }, {format_pointer(owned), "already", id_text(f.a)});
  e.forget(id);
  f.check_bytes();
}

TEST_CASE("register_buffer: a stream the device does not know, or no longer knows") {
  fixture f;
  eviction_engine& e = f.env.eng();
  void* p = f.env.alloc->allocate(8 * KiB);
  const stream_ref destroyed = f.env.sim->create_stream();
  f.env.sim->destroy_stream(destroyed);
  for (const stream_ref bogus : {stream_ref{999}, destroyed}) {
    CAPTURE(bogus.value);
    refused(f, [&] { (void)e.register_buffer(p, 8 * KiB, bogus); },
            {format_pointer(p), "stream " + std::to_string(bogus.value)});
  }
  // Refused, it is still the caller's: registered on a real stream it spills, and forget frees it.
  const buffer_id id = e.register_buffer(p, 8 * KiB, {});
  f.env.sim->run_until_idle();
  CHECK(e.evict(id, eviction_mode::spill));
  e.forget(id);
  f.env.sim->run_until_idle();
  f.check_bytes();
  f.g.forget_all();
  f.env.sim->run_until_idle();
  CHECK(f.env.allocated_bytes() == 0);
}

TEST_CASE("add_node: empty compute, no outputs, bad costs, unknown inputs") {
  fixture f;
  eviction_engine& e = f.env.eng();
  const auto noop = [](std::span<void* const>, std::span<void* const>, stream_ref) {};
  refused(f, [&] { (void)e.add_node({.name = "empty", .inputs = {f.s}}); }, {"add_node(empty)", "compute is empty"});
  refused(f, [&] { (void)e.add_node({.name = "none", .inputs = {f.s}, .output_count = 0, .compute = noop}); },
          {"none", "output_count is 0"});
  for (double cost : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0}) {
    CAPTURE(cost);
    refused(f, [&] { (void)e.add_node({.name = "costly", .inputs = {f.s}, .compute = noop, .cost_ns = cost}); },
            {"costly", "cost_ns", std::isnan(cost) ? "nan" : std::isinf(cost) ? "inf" : "-1"});
  }
  const buffer_id unknown{777};
  refused(f, [&] { (void)e.add_node({.name = "orphan", .inputs = {f.s, unknown}, .compute = noop}); },
          {id_text(unknown), "no such buffer"});
  f.check_bytes();
  // The refused nodes did not hold on to their inputs: once a and b are gone, s is freed.
  f.g.forget_all();
  f.env.sim->run_until_idle();
  CHECK(f.env.allocated_bytes() == 0);
}

TEST_CASE("outputs: index out of range, slot taken, size mismatch, unknown or retired producer") {
  fixture f;
  eviction_engine& e = f.env.eng();
  const auto noop = [](std::span<void* const>, std::span<void* const>, stream_ref) {};
  const node_id two = e.add_node({.name = "two", .inputs = {f.s}, .output_count = 2, .compute = noop});
  void* p = f.env.alloc->allocate(8 * KiB);
  refused(f, [&] { (void)e.register_buffer(p, 8 * KiB, {}, {.producer = two, .output_index = 2}); },
          {"output_index 2", "'two'", "2 output(s)"});
  refused(f, [&] { (void)e.register_buffer(p, 8 * KiB, {}, {.producer = f.n, .output_index = 0}); },
          {"output 0", "'n0'", "already", id_text(f.a)});
  refused(f, [&] { e.set_lineage(f.b, two, 5); }, {"output_index 5", "'two'"});
  refused(f, [&] { e.set_lineage(f.b, f.n, 0); }, {"output 0", "'n0'", id_text(f.a)});
  const node_id unknown{4242};
  refused(f, [&] { (void)e.register_buffer(p, 8 * KiB, {}, {.producer = unknown}); },
          {"lineage node 4242", "does not exist"});
  refused(f, [&] { e.set_lineage(f.a, unknown); }, {"lineage node 4242", "does not exist"});

  // A node that reads the buffer itself (an in-place update recorded as a = f(a)) could never
  // recompute it, and the two would keep each other alive after forget.
  const node_id in_place = e.add_node({.name = "in_place", .inputs = {f.s, f.a}, .compute = noop});
  refused(f, [&] { e.set_lineage(f.a, in_place); }, {id_text(f.a), "'in_place'", "reads"});

  // A slot whose buffer was forgotten keeps its size: a buffer of another size does not fit it.
  const buffer_id out0 = e.register_buffer(p, 8 * KiB, {}, {.producer = two, .output_index = 0});
  void* q = f.env.alloc->allocate(16 * KiB);
  const buffer_id out1 = e.register_buffer(q, 16 * KiB, {}, {.producer = two, .output_index = 1});
  e.forget(out1);
  void* r = f.env.alloc->allocate(4 * KiB);
  refused(f, [&] { (void)e.register_buffer(r, 4 * KiB, {}, {.producer = two, .output_index = 1}); },
          {"output 1", "'two'", "16384 bytes, not 4096"});
  // The last output forgotten: the node retires, and naming it is an error.
  e.forget(out0);
  refused(f, [&] { (void)e.register_buffer(r, 4 * KiB, {}, {.producer = two}); }, {"no longer exists"});
  f.env.alloc->deallocate(r);
  f.check_bytes();
  // Nothing refused above holds a buffer: with the node that reads a removed, all is freed.
  e.remove_node(in_place);
  f.g.forget_all();
  f.env.sim->run_until_idle();
  CHECK(f.env.allocated_bytes() == 0);
}

TEST_CASE("engine_config: a depth of 0 and an unknown policy are refused") {
  engine_env env;  // an allocator to build engines on
  env.engine.reset();  // one engine per allocator
  eviction::engine_config c;
  c.max_recompute_depth = 0;
  CHECK_THROWS_WITH_AS(eviction::eviction_engine(*env.alloc, c), doctest::Contains("max_recompute_depth is 0"),
                       invalid_argument);
  eviction::engine_config d;
  d.policy = "fifo";
  CHECK_THROWS_WITH_AS(eviction::eviction_engine(*env.alloc, d), doctest::Contains("fifo"), invalid_argument);
}

TEST_CASE("engine_config.bandwidth: one direction given is kept; bad ones refused, streams not leaked") {
  // Counts the streams made and destroyed on the simulated device.
  struct counting_backend final : forwarding_backend {
    using forwarding_backend::forwarding_backend;
    int created = 0, destroyed = 0;
    stream_ref create_stream() override {
      ++created;
      return forwarding_backend::create_stream();
    }
    void destroy_stream(stream_ref s) noexcept override {
      ++destroyed;
      forwarding_backend::destroy_stream(s);
    }
  };
  std::shared_ptr<counting_backend> counts;
  engine_options o;
  o.backend = [&counts](std::shared_ptr<sim_device> sim) {
    counts = std::make_shared<counting_backend>(std::move(sim));
    return counts;
  };
  engine_env env(o);
  env.engine.reset();  // one engine per allocator
  const int created = counts->created, destroyed = counts->destroyed;
  {
    eviction::engine_config c;
    c.bandwidth = {10e9, 0};  // host to device given; device to host found
    const eviction::eviction_engine e(*env.alloc, c);
    CHECK(e.costs().bandwidth().h2d == 10e9);
    CHECK(e.costs().bandwidth().d2h > 0);  // measured (the backend is not the sim itself)
    CHECK(e.costs().bandwidth().d2h != 10e9);
  }
  for (const eviction::link_bandwidth bad : {eviction::link_bandwidth{-1, 1e9},
                                             eviction::link_bandwidth{1e9, std::nan("")},
                                             eviction::link_bandwidth{std::numeric_limits<double>::infinity(), 1e9}}) {
    CAPTURE(bad.h2d);
    CAPTURE(bad.d2h);
    eviction::engine_config c;
    c.bandwidth = bad;
    CHECK_THROWS_AS(eviction::eviction_engine(*env.alloc, c), invalid_argument);
  }
  CHECK(counts->created - created == counts->destroyed - destroyed);  // the failed ones' too
  eviction::eviction_engine again(*env.alloc);  // and the allocator may have its engine
}

TEST_CASE("one engine per allocator: a second is refused, and the first goes on") {
  // Each engine allocates under its own lock, which runs the other's handler, which waits for
  // that other lock: two would deadlock evicting for each other on two threads.
  fixture f;
  CHECK_THROWS_WITH_AS(eviction::eviction_engine(*f.env.alloc), doctest::Contains("one engine per allocator"),
                       invalid_argument);
  CHECK(f.env.eng().evict(f.a));  // the first still serves the allocator
  f.g.expect(f.a);
  f.g.forget_all();
  f.env.engine.reset();
  eviction::eviction_engine again(*f.env.alloc);  // once the first is gone, another may come
}

TEST_CASE("an engine destroyed with a pin outstanding says what is pinned and aborts") {
  // A guard or a released pin outstanding would call into the engine afterwards, and its block
  // would be freed under the caller's pointer: the process stops instead, saying why. Run in a
  // child process, whose standard error comes back through a pipe.
  int err[2];
  REQUIRE(pipe(err) == 0);
  std::fflush(stderr);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::signal(SIGABRT, SIG_DFL);  // not doctest's crash report: the parent judges the abort
    dup2(err[1], STDERR_FILENO);
    close(err[0]);
    {
      engine_env env;
      lineage_graph g(env);
      const buffer_id x = g.source(64 * KiB);
      pinned_buffer p = env.eng().pin(x);
      (void)p.release();  // a released pin, never given back
      env.engine.reset();  // aborts here
    }
    _exit(0);
  }
  close(err[1]);
  std::string text;
  char buf[512];
  for (ssize_t n; (n = read(err[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
  close(err[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK(text.find("eviction_engine destroyed while 1 buffer(s) of 65536 bytes are pinned") != std::string::npos);
}

TEST_CASE("a clock that throws is read as its last time: no pin is left behind") {
  // now() is read between taking a pin and handing it out, and in unpin, which cannot throw.
  engine_options o;
  bool fail = false;
  std::uint64_t t = 1000;
  o.engine.clock = [&] {
    if (fail) throw std::runtime_error("clock");
    return t += 10;
  };
  engine_env env(o);
  lineage_graph g(env);
  const buffer_id x = g.source(64 * KiB);
  env.sim->run_until_idle();
  fail = true;
  {
    const pinned_buffer p = env.eng().pin(x);
    CHECK(env.eng().stats().pinned_bytes == 64 * KiB);
  }
  CHECK(env.eng().stats().pinned_bytes == 0);
  fail = false;
  CHECK(env.eng().evict(x));
  g.expect(x);
  env.check_clean();
}
