// test_host_memory_faults: the host running out of memory (std::bad_alloc from any allocation of
// the allocator, the engine or the host pool) loses and corrupts nothing (Note [Host out of
// memory]); an enqueue on the simulated device that fails for host memory leaves its stream as it
// was.
//
// Every operation under test runs once per host allocation it makes: run k fails the k-th one
// (counting from 0), in two modes, a single failure (the host recovers at once) and every
// allocation from the k-th on (the host stays out of memory until the operation returns). The
// sweep ends at the first k the operation does not reach. After each run, with the host's memory
// back:
// - the operation returned, or threw std::bad_alloc or spillway::out_of_memory, nothing else;
// - the allocator's blocks tile its segments and its statistics match its snapshot;
// - every registered buffer pins (restored or recomputed if it was evicted) and holds its bytes;
//   no kernel saw a wrong input;
// - every resident buffer is still a candidate for eviction;
// - no device block leaked: with every buffer forgotten, nothing is allocated and a release gives
//   every segment back; no host memory leaked (the ASan build runs this test under
//   LeakSanitizer).
//
// The operations: an allocation over budget served by compaction (Note [Compaction]), one served
// by spilling (no lineage), one served by dropping; pinning a buffer whose lineage was dropped
// (recursive recompute under pressure); rebuilding a node whose other outputs are resident;
// restoring a spilled buffer under pressure; lowering the budget below what is reserved; pinning
// spilled and dropped buffers together with next-use prediction, then a prefetch; the allocator
// alone with expandable segments (pages mapped, a cross-stream free, a release); registering a
// buffer, adding a node, setting and removing it; explicit evictions, a step boundary and forget;
// forgetting a buffer whose spill is in flight, and rebuilding a node whose other output's spill
// is (the host copy is dropped: the d2h queue and the in-flight list let go of it); an explicit
// spill whose copy cannot be queued (a copy fault: it says false, even when the host block's
// return to the pool runs out of memory); accepting a budget below what is reserved (set however
// it ends); constructing an engine (no copy stream left behind).
//
// The simulated device is shielded from the failures in those runs: it stands for the CUDA runtime,
// whose failures are the device and copy faults the sim injects (test_fault_injection). Its own
// promise is tested apart: an enqueue that fails for host memory leaves its stream as it was, so
// the work queued before it still runs and nothing waits forever.
//
// The failures come from this executable's replacement of the global operator new
// (host_fault_injection.hpp), armed on the test's thread only.
#include <doctest/doctest.h>

#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "forwarding_backend.hpp"
#include "host_fault_injection.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// The simulated device stands for the CUDA runtime: its own failures are the device and copy
// faults it injects (test_fault_injection), so host allocations inside it never fail here (kernel
// effects it runs included).
class shielded_backend final : public forwarding_backend {
 public:
  using forwarding_backend::forwarding_backend;
  int streams_created = 0, streams_destroyed = 0;  // an engine's copy streams, say
  stream_ref create_stream() override {
    const stream_ref s = forwarding_backend::create_stream();
    ++streams_created;
    return s;
  }
  void destroy_stream(stream_ref s) noexcept override {
    ++streams_destroyed;
    forwarding_backend::destroy_stream(s);
  }

 protected:
  void before(backend_call) override {
    if (depth_++ == 0) saved_ = t_countdown;
    t_countdown = -1;
  }
  void after() noexcept override {
    if (--depth_ == 0) t_countdown = saved_;
  }

 private:
  static thread_local int depth_;    // the calls run on the calling thread, as t_countdown
  static thread_local long saved_;
};

thread_local int shielded_backend::depth_ = 0;
thread_local long shielded_backend::saved_ = -1;

// One prepared state and the operation to run on it.
struct scenario {
  engine_env env;
  lineage_graph g{env};
  std::vector<void*> held;  // allocations of the test, freed before the check
  std::vector<buffer_id> registered;  // buffers outside the graph, forgotten before the check
  std::function<void(scenario&)> operation;
  std::function<bool(scenario&)> did;  // checked after the run without a failure
  std::function<void(scenario&)> check;  // checked after every run, before check_intact

  explicit scenario(engine_options o) : env(shield(std::move(o))) {
    held.reserve(8);  // the operation's push_back must not be what fails
    registered.reserve(8);
  }
  static engine_options shield(engine_options o) {
    o.capacity = 64 * MiB;  // a run per allocation: a small device keeps each one cheap
    o.engine.bandwidth = {o.h2d_bandwidth, o.d2h_bandwidth};  // the sim's: nothing to measure
    o.backend = [](std::shared_ptr<sim_device> sim) {
      return std::make_shared<shielded_backend>(std::move(sim));
    };
    return o;
  }
};

// The state the allocator and engine must be in after any run: see the file's header.
void check_intact(scenario& s, const std::string& run) {
  INFO(run);
  for (buffer_id id : s.registered) s.env.eng().forget(id);
  s.registered.clear();
  for (void* p : s.held) s.env.alloc->deallocate(p);
  s.held.clear();
  s.env.sim->run_until_idle();
  const memory_snapshot snap = s.env.alloc->snapshot();
  check_snapshot_invariants(snap);
  check_stats_match_snapshot(s.env.alloc->stats(), snap);
  // Every resident buffer can be evicted again: none fell out of the candidates.
  for (const lineage_graph::buffer_record& b : s.g.buffers()) {
    if (s.env.eng().state(b.id) != buffer_state::resident) continue;
    CHECK_MESSAGE(s.env.eng().describe_candidate(b.id).has_value(),
                  "buffer " << b.id.value << " is resident but not a candidate");
  }
  for (const lineage_graph::buffer_record& b : s.g.buffers()) {
    pinned_buffer p = s.env.eng().pin(b.id);
    s.env.sim->synchronize_stream(b.stream);
    CHECK_MESSAGE(checksum(p.get(), b.bytes) == b.sum,
                  "buffer " << b.id.value << " lost its bytes");
  }
  s.env.sim->run_until_idle();
  for (const std::string& f : s.env.log.failures()) FAIL_CHECK("kernel: " << f);
  // No device block leaked: with every buffer forgotten, nothing is allocated, and a release
  // gives every segment back (no free waits on an event forever).
  s.g.forget_all();
  s.env.sim->run_until_idle();
  CHECK(s.env.allocated_bytes() == 0);
  (void)s.env.alloc->empty_cache();
  CHECK(s.env.alloc->stats().reserved_bytes[0].current == 0);
}

// Runs `operation` on a fresh state from `make`, failing the k-th host allocation, for every k
// the operation reaches; returns how many runs injected a failure.
long sweep(const std::function<std::unique_ptr<scenario>()>& make, bool persistent) {
  long k = 0;
  for (;; ++k) {
    REQUIRE_MESSAGE(k < 100000, "the operation never ends without a failure");
    std::unique_ptr<scenario> s = make();
    const auto [error, failures] =
        run_with_host_fault(k, persistent, [&] { s->operation(*s); });
    std::string outcome = "returned";
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::bad_alloc&) {
        outcome = "bad_alloc";
      } catch (const out_of_memory&) {
        outcome = "out_of_memory";
      } catch (const std::exception& e) {
        outcome = e.what();
      }
    }
    const std::string run = std::string(persistent ? "every allocation from " : "allocation ") +
                            std::to_string(k) + " failed; the operation " + outcome;
    CHECK_MESSAGE((outcome == "returned" || outcome == "bad_alloc" || outcome == "out_of_memory"),
                  run);
    // Without a failure, the operation did what the scenario is about.
    if (failures == 0 && s->did) CHECK_MESSAGE(s->did(*s), run);
    if (s->check) {
      INFO(run);
      s->check(*s);
    }
    check_intact(*s, run);
    if (failures == 0) return k;  // the operation made fewer than k + 1 allocations
  }
}

void sweep_both(const std::function<std::unique_ptr<scenario>()>& make) {
  const long single = sweep(make, false);
  const long persistent = sweep(make, true);
  MESSAGE("host allocations failed one at a time: " << single << " runs; from one on: "
                                                    << persistent << " runs");
  CHECK(single > 0);  // the operation allocates: the sweep reached it
  CHECK(persistent > 0);
}

enum class segments { fixed, expandable };

// A scenario under `budget` with the named policy.
std::unique_ptr<scenario> under(std::size_t budget, segments kind, const char* policy,
                                bool allow_spill = true) {
  engine_options o;
  o.budget = budget;
  o.expandable_segments = kind == segments::expandable;
  o.engine.policy = policy;
  o.engine.allow_spill = allow_spill;
  return std::make_unique<scenario>(o);
}

// 4 MiB blocks (the sources are 8 bytes short of them), spill-only sources.
constexpr std::size_t k_source = 4 * MiB - 8;

// Compaction's layout (test_engine_compaction): two 20 MiB segments under a 40 MiB budget; A
// keeps one buffer, B two; a 12 MiB request fits in no hole.
std::unique_ptr<scenario> compaction_layout() {
  auto s = under(40 * MiB, segments::fixed, "lru");
  std::vector<buffer_id> ids;
  for (int i = 0; i < 10; ++i) ids.push_back(s->g.source(k_source));
  for (int i : {0, 1, 3, 4, 5, 7, 9}) s->g.forget(ids[static_cast<std::size_t>(i)]);
  s->operation = [](scenario& t) { t.held.push_back(t.env.alloc->allocate(12 * MiB)); };
  s->did = [](scenario& t) { return t.env.eng().stats().moves > 0; };
  return s;
}

// Eight spill-only 1 MiB sources fill an 8 MiB budget (expandable segments: no fragmentation).
std::unique_ptr<scenario> spill_layout(bool pin_spilled) {
  auto s = under(8 * MiB, segments::expandable, "lru");
  std::vector<buffer_id> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(s->g.source(1 * MiB));
  if (pin_spilled) {
    REQUIRE(s->env.eng().evict(ids[0], eviction::eviction_mode::spill));
    s->env.sim->run_until_idle();
    s->held.push_back(s->env.alloc->allocate(1 * MiB));  // the budget is full again
    s->operation = [id = ids[0]](scenario& t) {
      pinned_buffer p = t.env.eng().pin(id);  // restores it, spilling another
    };
    s->did = [](scenario& t) { return t.env.eng().stats().spills >= 2; };
  } else {
    s->operation = [](scenario& t) { t.held.push_back(t.env.alloc->allocate(3 * MiB)); };
    s->did = [](scenario& t) { return t.env.eng().stats().spills >= 3; };
  }
  return s;
}

// A chain x0 -> x1 -> ... -> x7 of 1 MiB buffers under an 8 MiB budget (expandable segments:
// 2 MiB pages), drop-only.
std::unique_ptr<scenario> chain_layout(bool pin_last) {
  auto s = under(8 * MiB, segments::expandable, "dtr", /*allow_spill=*/false);
  std::vector<buffer_id> x{s->g.source(1 * MiB)};
  for (int i = 1; i < 8; ++i) x.push_back(s->g.node({x.back()}, {1 * MiB})[0]);
  if (pin_last) {
    for (int i = 1; i < 7; ++i) drop(s->env.eng(), x[static_cast<std::size_t>(i)]);
    drop(s->env.eng(), x[7]);
    // Leave room for three buffers only (x0 among them): the recompute of x7 must drop what it
    // made on its way.
    s->held.push_back(s->env.alloc->allocate(4 * MiB));
    s->operation = [last = x[7]](scenario& t) { pinned_buffer p = t.env.eng().pin(last); };
    s->did = [](scenario& t) {
      const eviction::engine_stats st = t.env.eng().stats();
      return st.recomputes == 7 && st.drops > 7;  // x1..x7 made again, some dropped again
    };
  } else {
    s->operation = [](scenario& t) { t.held.push_back(t.env.alloc->allocate(2 * MiB)); };
    s->did = [](scenario& t) { return t.env.eng().stats().drops >= 2; };
  }
  return s;
}

// A node with three outputs: one dropped, two resident (one of them on another stream), rebuilt
// by pinning the dropped one; the candidates' list is filled to its capacity first, so that
// putting the siblings back needs room reserved before the node runs.
std::unique_ptr<scenario> siblings_layout() {
  engine_options o;
  o.streams = 1;
  auto s = std::make_unique<scenario>(o);
  const buffer_id x = s->g.source(64 * KiB);
  const std::vector<buffer_id> ys =
      s->g.node({x}, {64 * KiB, 32 * KiB, 16 * KiB}, {}, 1000, {}, {{}, {}, s->env.stream(0)});
  // 16 candidates (the list's capacity as it grows by doubling), then y0 dropped and one more
  // source: the list is full when the node runs.
  for (std::size_t n = 4; n < 16; ++n) s->g.source(8 * KiB);
  s->env.sim->run_until_idle();
  drop(s->env.eng(), ys[0]);
  s->g.source(8 * KiB);
  s->env.sim->run_until_idle();
  s->operation = [y = ys[0]](scenario& t) { pinned_buffer p = t.env.eng().pin(y); };
  s->did = [ys](scenario& t) {
    return t.env.eng().stats().recomputes == 1 &&
           t.env.eng().describe_candidate(ys[1]).has_value();
  };
  return s;
}

// Lowering the budget below what is reserved: the engine evicts (spills the sources, drops the
// chain's buffers) until the reservations fit, with PyTorch's segments.
std::unique_ptr<scenario> budget_layout(below_live when_below = below_live::refuse) {
  auto s = under(16 * MiB, segments::fixed, "dtr");
  std::vector<buffer_id> x{s->g.source(1 * MiB)};
  for (int i = 0; i < 5; ++i) x.push_back(s->g.source(512 * KiB));
  for (int i = 1; i < 8; ++i) x.push_back(s->g.node({x.back()}, {1 * MiB})[0]);
  s->env.sim->run_until_idle();
  auto returned = std::make_shared<bool>(false);
  s->operation = [returned, when_below](scenario& t) {
    (void)t.env.alloc->set_budget(6 * MiB, when_below);
    *returned = true;
  };
  s->did = [](scenario& t) {
    return t.env.alloc->stats().reserved_bytes[0].current <= static_cast<std::int64_t>(6 * MiB);
  };
  // A refusing call that threw leaves the old budget (it is lowered while the handlers run); an
  // accepting one (a scoped_budget's restore) sets the new one however it ends.
  s->check = [returned, when_below](scenario& t) {
    const bool set = *returned || when_below == below_live::accept;
    CHECK(t.env.alloc->budget() == (set ? 6 : 16) * MiB);
  };
  return s;
}

// pin_all of buffers spilled and dropped, under pressure, after two steps whose reads the engine
// recorded (next-use prediction on).
std::unique_ptr<scenario> pin_all_layout() {
  auto s = under(8 * MiB, segments::expandable, "dtr");
  std::vector<buffer_id> x{s->g.source(1 * MiB)};
  for (int i = 1; i < 6; ++i) x.push_back(s->g.node({x.back()}, {1 * MiB})[0]);
  for (int step = 0; step < 2; ++step) {
    s->env.eng().begin_step();
    for (buffer_id id : x) s->g.expect(id);
  }
  s->env.sim->run_until_idle();
  REQUIRE(s->env.eng().evict(x[0], eviction_mode::spill));
  drop(s->env.eng(), x[3]);
  drop(s->env.eng(), x[4]);
  s->env.sim->run_until_idle();
  s->held.push_back(s->env.alloc->allocate(3 * MiB));
  s->operation = [ids = std::vector<buffer_id>{x[0], x[4], x[5]}](scenario& t) {
    t.env.eng().begin_step();
    std::vector<pinned_buffer> pins = t.env.eng().pin_all(ids);
    t.env.eng().prefetch(ids[0]);
  };
  s->did = [x](scenario& t) {
    const buffer_state s0 = t.env.eng().state(x[0]);  // its copy back may still be queued
    return (s0 == buffer_state::resident || s0 == buffer_state::restoring) &&
           t.env.eng().state(x[4]) == buffer_state::resident && t.env.eng().stats().restores > 0;
  };
  return s;
}

// The allocator alone, with expandable segments: allocations that map pages, frees, a release of
// the free pages, allocations again; one block used on a second stream.
std::unique_ptr<scenario> expandable_layout() {
  engine_options o;
  o.expandable_segments = true;
  o.streams = 1;
  auto s = std::make_unique<scenario>(o);
  s->g.source(1 * MiB);
  s->operation = [](scenario& t) {
    void* a = t.env.alloc->allocate(3 * MiB);
    t.held.push_back(a);
    void* b = t.env.alloc->allocate(5 * MiB);
    t.held.push_back(b);
    t.env.alloc->record_stream(b, t.env.stream(0));
    t.held.pop_back();
    t.env.alloc->deallocate(b);  // waits for stream 1's event
    (void)t.env.alloc->empty_cache();
    t.held.push_back(t.env.alloc->allocate(7 * MiB));
    t.held.push_back(t.env.alloc->allocate(64 * KiB));
  };
  s->did = [](scenario& t) { return t.held.size() == 3; };
  return s;
}

// Registering a buffer and adding a node that produces it, on a roomy device.
std::unique_ptr<scenario> register_layout() {
  auto s = std::make_unique<scenario>(engine_options{});
  const buffer_id src = s->g.source(64 * KiB);
  s->operation = [src](scenario& t) {
    void* p = t.env.alloc->allocate(64 * KiB);
    t.held.push_back(p);
    t.registered.push_back(t.env.eng().register_buffer(p, 64 * KiB, {}));
    eviction::lineage_node n;
    n.name = "extra";
    n.inputs = {src};
    n.output_count = 1;
    n.compute = [](std::span<void* const>, std::span<void* const>, stream_ref) {};
    const node_id node = t.env.eng().add_node(std::move(n));
    t.env.eng().set_lineage(t.registered.back(), node);
    t.env.eng().remove_node(node);
  };
  return s;
}

// Explicit evictions (one spill, one drop), a step boundary with next-use prediction on, and
// forgetting a buffer, on a roomy device after one recorded step.
std::unique_ptr<scenario> evict_forget_layout() {
  auto s = std::make_unique<scenario>(engine_options{});  // predict_next_use is on by default
  std::vector<buffer_id> x{s->g.source(1 * MiB)};
  for (int i = 1; i < 4; ++i) x.push_back(s->g.node({x.back()}, {1 * MiB})[0]);
  s->env.eng().begin_step();
  for (const buffer_id id : x) pinned_buffer p = s->env.eng().pin(id);
  void* extra = s->env.alloc->allocate(64 * KiB);
  s->held.push_back(extra);
  s->registered.push_back(s->env.eng().register_buffer(extra, 64 * KiB, {}));
  s->operation = [x](scenario& t) {
    (void)t.env.eng().evict(x[1], eviction_mode::spill);
    (void)t.env.eng().evict(x[2], eviction_mode::drop);
    t.env.eng().begin_step();
    t.env.eng().forget(t.registered.back());
    t.registered.pop_back();
  };
  s->did = [x](scenario& t) {
    const buffer_state spilled = t.env.eng().state(x[1]);  // its copy may still be in flight
    return (spilled == buffer_state::spilling || spilled == buffer_state::spilled) &&
           t.env.eng().state(x[2]) == buffer_state::dropped && t.registered.empty();
  };
  return s;
}

// An explicit spill whose copy fails to queue (a copy fault of the sim): the buffer stays
// resident, and the host block taken for it goes back to the pool, or, with the host out of
// memory for the pool's lists, stays handed out; evict says false either way.
std::unique_ptr<scenario> failed_spill_layout() {
  auto s = std::make_unique<scenario>(engine_options{});
  const buffer_id a = s->g.source(1 * MiB);
  s->env.sim->run_until_idle();
  s->operation = [a](scenario& t) {
    t.env.sim->fail_nth(fault_site::copy, 1);
    bool evicted = true;
    try {
      evicted = t.env.eng().evict(a, eviction_mode::spill);
    } catch (const std::bad_alloc&) {
      FAIL_CHECK("evict threw bad_alloc: a spill that cannot start says false");
    }
    t.env.sim->clear_faults();
    CHECK_FALSE(evicted);
  };
  s->did = [a](scenario& t) { return t.env.eng().state(a) == buffer_state::resident; };
  s->check = [a](scenario& t) { CHECK(t.env.eng().state(a) == buffer_state::resident); };
  return s;
}

// A 1 MiB source whose spill is in flight (the sim's clock is manual: its copy waits for the next
// run), forgotten. Another source's spill cost shows the d2h queue: back to what it was once the
// copy, which still holds the copy engine, has completed (or at once, if no event could mark it).
std::unique_ptr<scenario> forget_spilling_layout() {
  auto s = std::make_unique<scenario>(engine_options{});
  const buffer_id a = s->g.source(1 * MiB);
  const buffer_id b = s->g.source(64 * KiB);
  s->env.sim->run_until_idle();
  const double spill_cost = s->env.eng().describe_candidate(b)->cost_ns;
  REQUIRE(s->env.eng().evict(a, eviction_mode::spill));
  REQUIRE(s->env.eng().state(a) == buffer_state::spilling);
  REQUIRE(s->env.eng().describe_candidate(b)->cost_ns > spill_cost);
  s->operation = [a](scenario& t) { t.g.forget(a); };
  s->check = [b, spill_cost](scenario& t) {
    t.env.sim->run_until_idle();
    CHECK(t.env.eng().state(b) == buffer_state::resident);  // a reap with a in no list
    CHECK(t.env.eng().describe_candidate(b)->cost_ns == spill_cost);
  };
  return s;
}

// y = n(x) with two outputs: y0 dropped, y1 spilling; pinning y0 runs n again, which makes y1
// resident too and drops its host copy while the spill's copy is still in flight.
std::unique_ptr<scenario> sibling_spilling_layout() {
  auto s = std::make_unique<scenario>(engine_options{});
  const buffer_id x = s->g.source(64 * KiB);
  const std::vector<buffer_id> ys = s->g.node({x}, {64 * KiB, 64 * KiB});
  s->env.sim->run_until_idle();
  const double spill_cost = s->env.eng().describe_candidate(x)->cost_ns;
  drop(s->env.eng(), ys[0]);
  REQUIRE(s->env.eng().evict(ys[1], eviction_mode::spill));
  REQUIRE(s->env.eng().state(ys[1]) == buffer_state::spilling);
  s->operation = [y = ys[0]](scenario& t) { pinned_buffer p = t.env.eng().pin(y); };
  s->did = [ys](scenario& t) { return t.env.eng().stats().recomputes == 1; };
  s->check = [x, ys, spill_cost](scenario& t) {
    const buffer_state s1 = t.env.eng().state(ys[1]);  // a reap, with y1 where it should be
    CHECK((s1 == buffer_state::resident || s1 == buffer_state::spilling ||
           s1 == buffer_state::spilled));
    if (s1 == buffer_state::resident) {  // rebuilt: once its spill's copy is done, none is queued
      t.env.sim->run_until_idle();
      (void)t.env.eng().state(ys[1]);  // reaps it
      CHECK(t.env.eng().describe_candidate(x)->cost_ns == spill_cost);
    }
  };
  return s;
}

}  // namespace

TEST_CASE("host out of memory: a free of what is not live is ignored, warning or not") {
  // deallocate is noexcept: the warning it builds may find no host memory, and the free must
  // then go on without it, not end the process.
  auto dev = std::make_shared<sim_device>();
  std::vector<std::string> warnings;
  allocator_config c;
  c.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  device_allocator alloc(dev, c);
  void* p = alloc.allocate(4096);
  CHECK(alloc.deallocate(p) == free_status::freed);
  int local = 0;
  for (long k = 0;; ++k) {
    CAPTURE(k);
    REQUIRE(k < 64);
    free_status twice{}, foreign{};
    const host_fault_run run = run_with_host_fault(k, true, [&] {
      twice = alloc.deallocate(p);
      foreign = alloc.deallocate(&local);
    });
    CHECK_FALSE(run.error);
    CHECK(twice == free_status::not_live);
    CHECK(foreign == free_status::unknown_pointer);
    if (run.failures == 0) break;
  }
  CHECK(alloc.stats().allocated_bytes[0].current == 0);
  CHECK_FALSE(warnings.empty());
}

TEST_CASE("host out of memory: an allocation served by compaction") {
  sweep_both(compaction_layout);
}

TEST_CASE("host out of memory: an allocation served by spilling") {
  sweep_both([] { return spill_layout(false); });
}

TEST_CASE("host out of memory: restoring a spilled buffer under pressure") {
  sweep_both([] { return spill_layout(true); });
}

TEST_CASE("host out of memory: an allocation served by dropping") {
  sweep_both([] { return chain_layout(false); });
}

TEST_CASE("host out of memory: a recursive recompute under pressure") {
  sweep_both([] { return chain_layout(true); });
}

TEST_CASE("host out of memory: a node rebuilt while its other outputs are resident") {
  sweep_both(siblings_layout);
}

TEST_CASE("host out of memory: lowering the budget below what is reserved") {
  sweep_both([] { return budget_layout(); });
}

TEST_CASE("host out of memory: accepting a budget below what is reserved sets it however it ends") {
  sweep_both([] { return budget_layout(below_live::accept); });
}

TEST_CASE("host out of memory: pin_all of spilled and dropped buffers, with next-use prediction") {
  sweep_both(pin_all_layout);
}

TEST_CASE("host out of memory: the allocator alone, expandable segments, a cross-stream free") {
  sweep_both(expandable_layout);
}

TEST_CASE("host out of memory: registering a buffer and adding a node") {
  sweep_both(register_layout);
}

TEST_CASE("host out of memory: explicit evictions, a step boundary and forget") {
  sweep_both(evict_forget_layout);
}

TEST_CASE("host out of memory: forgetting a buffer whose spill is in flight") {
  sweep_both(forget_spilling_layout);
}

TEST_CASE("host out of memory: a recompute drops a sibling's host copy while its spill is in flight") {
  sweep_both(sibling_spilling_layout);
}

TEST_CASE("host out of memory: a spill whose copy cannot be queued") {
  sweep_both(failed_spill_layout);
}

TEST_CASE("host out of memory in the simulated device: a failed enqueue leaves its stream as is") {
  for (const bool persistent : {false, true}) {
    long k = 0;
    for (;; ++k) {
      REQUIRE(k < 10000);
      const std::string mode = persistent ? "every allocation from " : "allocation ";
      INFO(mode << k << " failed");
      auto sim = std::make_shared<sim_device>(sim_config{});
      const stream_ref s1 = sim->create_stream(), s2 = sim->create_stream();
      const event_ref e = sim->create_event();
      void* dev = sim->reserve_segment(2 * MiB);
      std::vector<unsigned char> host(2 * MiB, 0x3C);
      int kernels_queued = 0, kernels_ran = 0;
      bool copies_queued[2] = {false, false};
      long failures = 0;
      {
        host_fault_scope armed(k, persistent);
        try {
          sim->launch(s1, 1000, [&] { ++kernels_ran; });
          ++kernels_queued;
          sim->record_event(e, s1);
          sim->stream_wait_event(s2, e);  // s2 parks on s1's record
          sim->launch(s2, 1000, [&] { ++kernels_ran; });
          ++kernels_queued;
          // The second copy parks on the busy host-to-device engine.
          sim->copy_async(dev, host.data(), MiB, copy_kind::host_to_device, s1);
          copies_queued[0] = true;
          sim->copy_async(static_cast<char*>(dev) + MiB, host.data(), MiB,
                          copy_kind::host_to_device, s2);
          copies_queued[1] = true;
          sim->launch(s2, 1000, [&] { ++kernels_ran; });
          ++kernels_queued;
        } catch (const std::bad_alloc&) {
        }
        failures = t_failures;
      }
      // Nothing is left waiting forever: each stream drains.
      CHECK_NOTHROW(sim->synchronize_stream(s1));
      CHECK_NOTHROW(sim->synchronize_stream(s2));
      CHECK_NOTHROW(sim->run_until_idle());
      CHECK(kernels_ran == kernels_queued);
      for (int c = 0; c < 2; ++c) {
        const auto* d = static_cast<const unsigned char*>(dev) + c * MiB;
        CHECK_MESSAGE((d[0] == 0x3C && d[MiB - 1] == 0x3C) == copies_queued[c], "copy " << c);
      }
      sim->release_segment(dev, 2 * MiB);
      sim->destroy_event(e);
      sim->destroy_stream(s1);
      sim->destroy_stream(s2);
      if (failures == 0) break;
    }
    const std::string mode = persistent ? "from one on: " : "one at a time: ";
    MESSAGE("host allocations failed " << mode << k << " runs");
    CHECK(k > 0);
  }
}

TEST_CASE("host out of memory: constructing an engine leaves no stream behind") {
  // Its copy streams are made first; whatever fails after (the cost model, the registry, the
  // allocator's handler list), they go with it.
  for (const bool persistent : {false, true}) {
    for (long k = 0;; ++k) {
      REQUIRE(k < 10000);
      INFO((persistent ? "every allocation from " : "allocation ") << k << " failed");
      auto sim = std::make_shared<sim_device>(sim_config{});
      auto backend = std::make_shared<shielded_backend>(sim);
      device_allocator alloc(backend);
      eviction::engine_config c;
      c.bandwidth = {sim->config().h2d_bandwidth, sim->config().d2h_bandwidth};
      std::unique_ptr<eviction::eviction_engine> engine;
      const host_fault_run run = run_with_host_fault(k, persistent, [&] {
        engine = std::make_unique<eviction::eviction_engine>(alloc, c);
      });
      if (run.error) {
        CHECK(engine == nullptr);
        CHECK(backend->streams_created == backend->streams_destroyed);
      }
      engine.reset();
      CHECK(backend->streams_created == backend->streams_destroyed);
      if (run.failures == 0) break;
    }
  }
}
