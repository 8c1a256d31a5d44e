// test_libtorch_host_faults: the host running out of memory (std::bad_alloc from any allocation,
// the activation manager's own and LibTorch's under it) in the torch plugin's activation manager
// loses and corrupts nothing (Note [Host out of memory]).
//
// Every operation under test runs once per host allocation it makes: run k fails the k-th one,
// in two modes, a single failure and every allocation from the k-th on, until the operation
// returns (host_fault_injection.hpp). The sweep ends at the first k the operation does not reach.
// After each run, with the host's memory back:
// - the operation returned, or threw std::bad_alloc (or LibTorch's c10::Error carrying it);
// - every handle unpacks to the bytes saved (restored or recomputed if it was evicted);
// - the manager's accounting holds: with every storage resident, resident_bytes is their sum and
//   nothing counts as spilled or dropped;
// - every storage is evictable again once the program lets go of it, and comes back again;
// - with every handle released, no entry is left.
//
// The operations, on CPU tensors: spilling every storage; dropping every storage of a segment;
// copying a spilled storage back (with prefetch of the others); evicting storages restored ahead
// (their host copies kept: no copy out); recomputing a dropped segment;
// recomputing a chain of two dropped segments (the second's input is the first's output);
// registering a storage under max_resident 0 (the save evicts at once), in hybrid and drop mode;
// running a segment (begin, a save, end with its output).
#include "torch_doctest.hpp"  // ATen and doctest
#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "activation_manager.hpp"
#include "host_fault_injection.hpp"
#include "libtorch_activations.hpp"
#include "spillway/errors.hpp"

using namespace spillway::torch_plugin;
using spillway::test::run_with_host_fault;

namespace {

constexpr std::int64_t n = 4096;  // floats per storage: 16 KiB
constexpr std::size_t storage_bytes = n * sizeof(float);

at::Tensor value(float v) { return at::full({n}, v); }

// A segment whose replay computes its saved tensors and output from its inputs (or from nothing),
// as its first run did.
segment_replay replay_of(std::vector<float> saved, float output) {
  return [saved, output](const std::vector<at::Tensor>& inputs, std::optional<std::size_t>) {
    const at::Tensor base = inputs.empty() ? value(0) : inputs[0];
    segment_run run;
    for (float v : saved) run.saved.push_back(base + v);
    run.outputs.push_back(base + output);
    return run;
  };
}

struct scenario {
  std::shared_ptr<activation_manager> manager;
  std::vector<std::shared_ptr<activation_manager::saved>> handles;
  std::vector<at::Tensor> expected;  // per handle, the bytes it must give back
  std::vector<at::Tensor> pending;   // the same for the handles the operation may add, in order
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;  // of the saves before it
  std::size_t held_by_segments = 0;  // entries no handle holds: segment inputs
  std::function<void(scenario&)> operation;
  std::function<void(scenario&)> after;  // run after the operation, without failures
  std::function<bool(scenario&)> did;    // checked after a run without a failure
  // Instead of check_intact, for a scenario whose storages autograd holds, not `handles`.
  std::function<void(scenario&)> check;
  at::Tensor x, out;  // such a scenario's leaf and result

  explicit scenario(activation_options o) : manager(activation_manager::make(o)) {
    handles.reserve(16);  // the operation's push_back must not be what fails
    expected.reserve(16);
  }
  void save(const at::Tensor& t) {
    handles.push_back(manager->pack(t));
    REQUIRE(handles.back() != nullptr);
    expected.push_back(t.clone());
    storages.push_back(t.storage().getWeakStorageImpl());
  }
  std::size_t evict_all() { return manager->evict(std::size_t{1} << 40).first; }
};

activation_options options_for(activation_mode mode) {
  activation_options o;
  o.mode = mode;
  o.min_bytes = 0;
  return o;
}

// Segment 1 on nothing saves 1 and 2 and returns 3; segment 2 on its output saves 3 + 10 and
// returns 3 + 20. The tensors are temporaries: afterwards only the manager holds them (segment 2
// holds the boundary, its input).
void two_segments(scenario& s) {
  s.manager->begin_segment(replay_of({1, 2}, 3), {}, {});
  s.save(value(1));
  s.save(value(2));
  at::Tensor boundary = value(3);
  s.manager->end_segment(1e-3, {boundary});
  s.manager->begin_segment(replay_of({10}, 20), {}, {boundary});
  s.save(boundary + 10);
  s.manager->end_segment(1e-3, {boundary + 20});
  s.held_by_segments = 1;  // the boundary
}

// The state the manager must be in after any run: see the file's header.
void check_intact(scenario& s, const std::string& run) {
  INFO(run);
  // First, as the operation left them: an evicted storage holds no memory (a refill that failed
  // half-way left one with its memory and 0 bytes: counted nowhere, never evictable).
  for (const auto& weak : s.storages) {
    if (c10::intrusive_ptr<c10::StorageImpl> storage = weak.lock()) {
      CHECK_MESSAGE((storage->nbytes() == 0) == (storage->data() == nullptr),
                    "a storage of " << storage->nbytes() << " bytes at " << storage->data());
    }
  }
  if (s.after) s.after(s);
  for (std::size_t j = 0; s.expected.size() < s.handles.size(); ++j) {
    s.expected.push_back(s.pending.at(j));  // the operation's saves that were made
  }
  const std::size_t entries = s.handles.size() + s.held_by_segments;
  const auto check_all = [&] {
    std::vector<at::Tensor> used;
    for (std::size_t i = 0; i < s.handles.size(); ++i) {
      at::Tensor got = s.manager->unpack(*s.handles[i]);
      CHECK_MESSAGE(at::equal(got, s.expected[i]), "handle " << i << " lost its bytes");
      used.push_back(got);
    }
    const activation_stats st = s.manager->stats();
    CHECK(st.registered == entries);
    CHECK(st.resident_bytes == entries * storage_bytes);
    CHECK(st.spilled_bytes == 0);
    CHECK(st.kept_host_bytes == 0);  // a prefetch's host copy goes at the unpack
    CHECK(st.dropped_bytes == 0);
  };
  check_all();
  // Evictable again, every one (spilled, or dropped where the mode allows), and back again.
  CHECK(s.evict_all() == entries * storage_bytes);
  check_all();
  s.handles.clear();
  CHECK(s.manager->stats().registered == 0);
  CHECK(s.manager->stats().resident_bytes == 0);
}

// Runs the operation on a fresh state from `make`, failing the k-th host allocation, for every k
// it reaches; returns how many runs injected a failure.
long sweep(const std::function<std::unique_ptr<scenario>()>& make, bool persistent) {
  for (long k = 0;; ++k) {
    REQUIRE_MESSAGE(k < 100000, "the operation never ends without a failure");
    std::unique_ptr<scenario> s = make();
    const auto [error, failures] =
        run_with_host_fault(k, persistent, [&] { s->operation(*s); });
    std::string outcome = "returned";
    bool expected = true;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::bad_alloc&) {
        outcome = "bad_alloc";
      } catch (const c10::Error& e) {  // LibTorch reports a failure inside an op this way
        outcome = e.what();
        expected = outcome.find("bad_alloc") != std::string::npos;
      } catch (const std::exception& e) {
        outcome = e.what();
        expected = false;
      }
    }
    const std::string run = std::string(persistent ? "every allocation from " : "allocation ") +
                            std::to_string(k) + " failed; the operation " + outcome;
    CHECK_MESSAGE(expected, run);
    if (failures == 0 && s->did) CHECK_MESSAGE(s->did(*s), run);
    if (s->check) {
      INFO(run);
      s->check(*s);
    } else {
      check_intact(*s, run);
    }
    if (failures == 0) return k;
  }
}

void sweep_both(const std::function<std::unique_ptr<scenario>()>& make) {
  const long single = sweep(make, false);
  const long persistent = sweep(make, true);
  MESSAGE("host allocations failed one at a time: " << single << " runs; from one on: "
                                                    << persistent << " runs");
  CHECK(single > 0);
  CHECK(persistent > 0);
}

}  // namespace

TEST_CASE("spilling every storage") {
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::spill));
    for (float v : {1.0f, 2.0f, 3.0f}) s->save(value(v));
    s->operation = [](scenario& t) { t.evict_all(); };
    s->did = [](scenario& t) { return t.manager->stats().spills == 3; };
    return s;
  });
}

TEST_CASE("dropping every storage of a segment") {
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::drop));
    two_segments(*s);
    s->operation = [](scenario& t) { t.evict_all(); };
    s->did = [](scenario& t) { return t.manager->stats().drops == 4; };  // the boundary too
    return s;
  });
}

TEST_CASE("copying a spilled storage back, prefetching the others") {
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::spill));
    for (float v : {1.0f, 2.0f, 3.0f}) s->save(value(v));
    REQUIRE(s->evict_all() == 3 * storage_bytes);
    s->operation = [](scenario& t) { at::Tensor got = t.manager->unpack(*t.handles[2]); };
    s->did = [](scenario& t) { return t.manager->stats().prefetches == 2; };
    return s;
  });
}

TEST_CASE("evicting storages restored ahead, whose host copies are kept") {
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::spill));
    for (float v : {1.0f, 2.0f, 3.0f}) s->save(value(v));
    REQUIRE(s->evict_all() == 3 * storage_bytes);
    { at::Tensor got = s->manager->unpack(*s->handles[2]); }  // restores 1 and 0 ahead
    REQUIRE(s->manager->stats().kept_host_bytes == 2 * storage_bytes);
    s->operation = [](scenario& t) { t.evict_all(); };
    s->did = [](scenario& t) {
      const activation_stats st = t.manager->stats();
      return st.clean_evictions == 2 && st.spills == 4 && st.kept_host_bytes == 0;
    };
    return s;
  });
}

TEST_CASE("recomputing a dropped segment") {
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::drop));
    two_segments(*s);
    REQUIRE(s->evict_all() == 4 * storage_bytes);  // the boundary too
    s->operation = [](scenario& t) { at::Tensor got = t.manager->unpack(*t.handles[0]); };
    s->did = [](scenario& t) { return t.manager->stats().recomputes == 1; };
    return s;
  });
}

TEST_CASE("recomputing a chain of two dropped segments") {
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::drop));
    two_segments(*s);
    REQUIRE(s->evict_all() == 4 * storage_bytes);  // the boundary too
    // The second segment's save: its input, the boundary, was dropped with the first segment.
    s->operation = [](scenario& t) { at::Tensor got = t.manager->unpack(*t.handles[2]); };
    s->did = [](scenario& t) { return t.manager->stats().nested_recomputes == 1; };
    return s;
  });
}

TEST_CASE("registering a storage that is evicted at once (max_resident 0)") {
  for (activation_mode mode : {activation_mode::hybrid, activation_mode::drop}) {
    CAPTURE(static_cast<int>(mode));
    sweep_both([mode] {
      activation_options o = options_for(mode);
      o.max_resident = 0;
      auto s = std::make_unique<scenario>(o);
      s->manager->begin_segment(replay_of({1, 2}, 3), {}, {});
      s->save(value(1));  // resident: the program held it until the save returned
      s->pending.push_back(value(2));
      // The save evicts the storage saved before it (this one is the caller's still).
      s->operation = [](scenario& t) { t.handles.push_back(t.manager->pack(value(2))); };
      s->after = [](scenario& t) { t.manager->end_segment(1e-3); };
      s->did = [](scenario& t) { return t.manager->stats().evictions == 1; };
      return s;
    });
  }
}

TEST_CASE("running a segment: begin, a save, end with its output") {
  // As the LibTorch binding runs one: whatever fails before end_segment ends the segment too.
  sweep_both([] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::hybrid));
    s->save(value(5));  // the segment's input, saved by an op before it
    s->pending.push_back(value(6));
    s->operation = [](scenario& t) {
      at::Tensor input = t.manager->unpack(*t.handles[0]);
      t.manager->begin_segment(replay_of({1}, 2), {}, {input});
      std::vector<at::Tensor> outputs;
      try {
        t.handles.push_back(t.manager->pack(input + 1));
        outputs.push_back(input + 2);
      } catch (...) {
        t.manager->end_segment(0);
        throw;
      }
      t.manager->end_segment(1e-3, outputs);
    };
    s->did = [](scenario& t) { return t.manager->stats().registered == 2; };
    return s;
  });
}

TEST_CASE("a checkpoint segment through the LibTorch binding") {
  // The binding ends the segment whatever fails in it, so no later save takes a dead segment as
  // lineage; a segment that ran is dropped and recomputed with exact gradients. One failure at a
  // time only: with every allocation failing, LibTorch's autograd ends the process (deleteNode,
  // freeing the graph of an op that threw, allocates while the exception unwinds: terminate).
  enable_libtorch_hooks();
  const auto block = [](const std::vector<at::Tensor>& in) { return in[0].sin().cos(); };
  const at::Tensor x0 = at::randn({n});
  at::Tensor reference;
  {
    at::Tensor x = x0.clone().requires_grad_();
    block({x}).sum().backward();
    reference = x.grad();
  }
  const long runs = sweep([&] {
    auto s = std::make_unique<scenario>(options_for(activation_mode::drop));
    s->x = x0.clone().requires_grad_();
    s->operation = [&block](scenario& t) {
      activation_scope scope(t.manager);
      t.out = checkpoint(block, {t.x});
    };
    s->did = [](scenario& t) { return t.out.defined(); };
    s->check = [&reference](scenario& t) {
      CHECK_THROWS_AS(t.manager->end_segment(0), spillway::invalid_argument);  // none open
      if (t.out.defined()) {
        CHECK(t.evict_all() > 0);
        t.out.sum().backward();
        CHECK(at::equal(t.x.grad(), reference));
        CHECK(t.manager->stats().recomputes == 1);
        t.out.reset();
      }
      CHECK(t.manager->stats().registered == 0);
    };
    return s;
  }, /*persistent=*/false);
  MESSAGE("host allocations failed one at a time: " << runs << " runs");
  CHECK(runs > 0);
}
