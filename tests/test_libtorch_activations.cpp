// test_libtorch_activations: the LibTorch route (torch_plugin/libtorch_activations.hpp) and the
// activation_manager under it, on CPU tensors.
//
// (The restores of dropped segments, nested replays and early stop: test_libtorch_restores.cpp;
// storages restored ahead, kept host copies and the prefetch depth: test_libtorch_prefetch.cpp.)
// Proves that, through the replaced engine's default saved-variable hooks, gradients are
// bit-identical to a plain run when every checkpoint segment is dropped and recomputed (with
// dropout: the RNG state is replayed) and when every activation is spilled and copied back; that
// in-place state listed in `keep` is updated once; that a storage the program holds is never
// evicted; that a non-deterministic segment fails clearly; that a replay never refills a storage
// that took the address of one its segment saved (it did: silently wrong bytes), nor leaves a
// storage empty when the replay saves one tensor where the first run saved two; that a spill
// without host memory (max_spilled, or a host allocation that fails) loses nothing; and that bad
// options name the value.
#include "torch_doctest.hpp"  // ATen and doctest
#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "libtorch_activation_options.hpp"
#include "libtorch_activations.hpp"
#include "libtorch_test_mlp.hpp"
#include "spillway/errors.hpp"

using namespace spillway::torch_plugin;

namespace {

using mlp = spillway::test::libtorch_test_mlp;
using spillway::test::drop_when_asked;
using spillway::test::evict_all;  // default shape: width 128, relu, dropout 0.2

struct result {
  at::Tensor loss, running;
  std::vector<at::Tensor> grads;
};

result train_step(const std::shared_ptr<activation_manager>& manager, bool segments) {
  mlp model;
  at::Tensor x = at::randn({256, 128});
  at::manual_seed(42);
  at::Tensor loss;
  if (manager) {
    activation_scope scope(manager);
    loss = model.forward(x, segments).square().mean();
  } else {
    loss = model.forward(x, segments).square().mean();
  }
  loss.backward();
  return {loss.detach(), model.running.clone(), model.grads()};
}

void check_identical(const result& a, const result& b) {
  CHECK(at::equal(a.loss, b.loss));
  CHECK(at::equal(a.running, b.running));
  REQUIRE(a.grads.size() == b.grads.size());
  for (std::size_t i = 0; i < a.grads.size(); ++i) CHECK(at::equal(a.grads[i], b.grads[i]));
}

}  // namespace

TEST_CASE("dropped checkpoint segments are recomputed bit-identically, state updated once") {
  enable_libtorch_hooks();
  enable_libtorch_hooks();  // a second call is a no-op
  const result reference = train_step(nullptr, false);
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  const result got = train_step(manager, true);
  check_identical(reference, got);
  const activation_stats s = manager->stats();
  CHECK(s.drops > 0);
  CHECK(s.recomputes > 0);
  CHECK(s.spills == 0);
  CHECK(s.registered == 0);  // everything released after backward
  CHECK(s.resident_bytes == 0);
  // The boundaries (a segment's output, the next one's input) were dropped too: restoring the
  // last segment's input replayed the segments before it first.
  CHECK(s.nested_recomputes > 0);
  // Refilled by taking the replay's memory: nothing else (not the replay's own graph, kept alive
  // by the output it returns) holds it.
  CHECK(s.recompute_moves > 0);
}

TEST_CASE("a segment's input is evictable once the program lets go of it") {
  // Before, the replay held its inputs: a checkpoint boundary stayed resident as long as its
  // segment lived. Now the manager holds them and hands them back to the replay.
  enable_libtorch_hooks();
  const auto first = [](const std::vector<at::Tensor>& in) { return in[0].square(); };
  const auto second = [](const std::vector<at::Tensor>& in) { return in[0].square().sin(); };
  const at::Tensor w0 = at::randn({1024});
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    at::Tensor loss;
    if (manager) {
      activation_scope scope(manager);
      at::Tensor h = checkpoint(first, {w * 3});
      loss = checkpoint(second, {h}).sum();
    } else {
      loss = second({first({w * 3})}).sum();
    }
    if (manager) {
      // w * 3, the first segment's input, has no lineage (drop mode keeps it); its output h, the
      // second's input, has the first segment as lineage; h.square() has the second.
      REQUIRE(manager->evict(std::size_t{1} << 30).first == 2 * 1024 * sizeof(float));
      CHECK(manager->stats().dropped_bytes == 2 * 1024 * sizeof(float));
    }
    loss.backward();
    return w.grad();
  };
  const at::Tensor reference = run(nullptr);
  auto manager = activation_manager::make(drop_when_asked());
  CHECK(at::equal(run(manager), reference));
  // sin's input came back by replaying the second segment, whose input h came back first by
  // replaying the first; square's h was resident then.
  const activation_stats s = manager->stats();
  CHECK(s.recomputes == 2);
  CHECK(s.nested_recomputes == 1);
  CHECK(s.registered == 0);
}

TEST_CASE("an output modified in place after its segment is never recomputed from it") {
  // Its segment's replay would return the bytes before the change: such a storage takes no
  // lineage, and is kept (drop mode) instead of being refilled with the wrong bytes.
  enable_libtorch_hooks();
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  const auto square = [](const std::vector<at::Tensor>& in) { return in[0].square(); };
  at::Tensor w = at::randn({1024}).requires_grad_();
  at::Tensor loss;
  {
    activation_scope scope(manager);
    at::Tensor h = checkpoint(square, {w * 3});
    h.mul_(2);
    at::Tensor y = checkpoint(square, {h});
    loss = y.sum();
  }
  loss.backward();
  // y = (2 (3w)^2)^2 = 324 w^4: dy/dw = 1296 w^3.
  CHECK(at::allclose(w.grad(), 1296 * w.detach().pow(3)));
  CHECK(manager->stats().nested_recomputes == 0);
}

TEST_CASE("spilled activations come back identical, prefetched in backward order into room") {
  // Each activation is 128 KiB (256 x 128 floats). A cap of one leaves room to restore one ahead;
  // with a cap of 0 a storage restored ahead would be evicted again at once (a copy each way for
  // nothing): none is, and each comes back when it is unpacked.
  enable_libtorch_hooks();
  const result reference = train_step(nullptr, false);
  for (const std::size_t cap : {std::size_t{128} << 10, std::size_t{0}}) {
    CAPTURE(cap);
    auto options = evict_all(activation_mode::spill);
    options.max_resident = cap;
    options.prefetch = cap > 0 ? 1 : 4;
    auto manager = activation_manager::make(options);
    const result got = train_step(manager, false);
    check_identical(reference, got);
    const activation_stats s = manager->stats();
    CHECK(s.spills > 0);
    CHECK(s.restores == s.spills);
    CHECK((s.prefetches > 0) == (cap > 0));
    CHECK(s.prefetches_unused == 0);  // every storage restored ahead was unpacked
    CHECK(s.drops == 0);
  }
}

TEST_CASE("the link's bandwidth is measured from the managers' copies, unless it is given") {
  // CPU storages: each copy is timed on the host clock (activation_link.hpp). The estimates are
  // the process's, so an earlier test's copies may have measured this link already.
  constexpr std::int64_t n = 1 << 18;  // 1 MiB each
  for (const bool given : {false, true}) {
    CAPTURE(given);
    activation_options o;
    o.mode = activation_mode::spill;
    if (given) o.link_bandwidth = 3e9;
    auto manager = activation_manager::make(o);
    const activation_stats before = manager->stats();
    CHECK(before.has_link);
    if (given) CHECK(before.spill_bytes_per_s == 3'000'000'000u);
    std::vector<std::shared_ptr<activation_manager::saved>> handles;
    for (int i = 0; i < 8; ++i) handles.push_back(manager->pack(at::full({n}, float(i))));
    REQUIRE(manager->evict(std::size_t{1} << 30).first == 8 * n * sizeof(float));
    for (int i = 0; i < 8; ++i) CHECK(at::equal(manager->unpack(*handles[i]), at::full({n}, float(i))));
    const activation_stats s = manager->stats();
    REQUIRE(s.restores == 8);
    if (given) {
      CHECK(s.spill_bytes_per_s == 3'000'000'000u);
      CHECK(s.restore_bytes_per_s == 3'000'000'000u);
    } else {  // its own copies moved the estimate (memcpy's speed on this machine) ...
      CHECK(s.spill_bytes_per_s != before.spill_bytes_per_s);
      CHECK(s.restore_bytes_per_s != before.restore_bytes_per_s);
      CHECK(s.spill_bytes_per_s != 25'000'000'000u);
      // ... which the next manager starts from (the process's estimates), before any copy.
      const activation_stats next = activation_manager::make(activation_options{})->stats();
      CHECK(next.spill_bytes_per_s == s.spill_bytes_per_s);
      CHECK(next.restore_bytes_per_s == s.restore_bytes_per_s);
    }
  }
}

TEST_CASE("hybrid mode without pressure evicts nothing") {
  enable_libtorch_hooks();
  auto manager = activation_manager::make({});
  (void)train_step(manager, true);
  CHECK(manager->stats().evictions == 0);
  CHECK(manager->stats().packed > 0);
}

TEST_CASE("a storage the program holds is never evicted") {
  enable_libtorch_hooks();
  auto manager = activation_manager::make(evict_all(activation_mode::spill));
  at::Tensor x = at::randn({128, 128}).requires_grad_();
  at::Tensor h, y;
  {
    activation_scope scope(manager);
    h = x.exp();  // saved by exp's backward, and held here
    y = h.sin();
  }
  const at::Tensor before = h.detach().clone();
  REQUIRE(manager->state_of(h).has_value());
  CHECK(*manager->state_of(h) == "resident");
  manager->evict(std::size_t{1} << 30);
  CHECK(*manager->state_of(h) == "resident");
  CHECK(at::equal(h.detach(), before));
  y.sum().backward();
  CHECK(at::allclose(x.grad(), x.detach().exp().cos() * x.detach().exp()));
}

TEST_CASE("a small saved output does not keep its own graph alive") {
  // Under min_bytes a saved tensor is kept as it is. A saved output comes to the pack hook with
  // its grad_fn: kept undetached, the node would hold itself through it and never be freed.
  enable_libtorch_hooks();
  activation_options o;
  o.min_bytes = std::size_t{1} << 30;
  auto manager = activation_manager::make(o);
  at::Tensor x = at::randn({16}).requires_grad_();
  at::Tensor y, z;
  {
    activation_scope scope(manager);
    y = x.exp();  // exp saves its output
    z = y.sum();
  }
  c10::weak_intrusive_ptr<c10::TensorImpl> output(y.getIntrusivePtr());
  y.reset();
  z.reset();
  CHECK(output.expired());
}

TEST_CASE("a save on another thread inside a segment's run is not the segment's") {
  // Segments are per thread: while this thread runs a segment, a tensor saved by another thread
  // in the same manager's scope must not be listed in it (its replay would refill the segment's
  // saves from the wrong positions) nor take it as lineage.
  enable_libtorch_hooks();
  const auto run = [](const std::shared_ptr<activation_manager>& manager) {
    at::manual_seed(7);
    at::Tensor x = at::randn({256}).requires_grad_();
    at::Tensor other_loss;
    const auto body = [&](const std::vector<at::Tensor>& in) {
      if (manager && !other_loss.defined()) {  // the first run only, not the replay
        std::thread([&] {
          activation_scope scope(manager);
          at::Tensor a = at::randn({256}).requires_grad_();
          other_loss = a.exp().sum();  // saves exp's output, of the size of the segment's saves
        }).join();
      }
      return in[0].sin().exp();  // saves in[0], then exp's output
    };
    at::Tensor loss;
    if (manager) {
      activation_scope scope(manager);
      loss = checkpoint(body, {x * 2}).sum();
    } else {
      loss = body({x * 2}).sum();
    }
    if (manager) manager->evict(std::size_t{1} << 30);  // every entry it may drop
    loss.backward();
    if (other_loss.defined()) other_loss.backward();
    return x.grad().clone();
  };
  const at::Tensor expected = run(nullptr);
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  const at::Tensor got = run(manager);
  CHECK(at::equal(expected, got));
  CHECK(manager->stats().recomputes > 0);
}

TEST_CASE("a segment that saves different sizes the second time fails clearly") {
  enable_libtorch_hooks();
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  at::Tensor x = at::randn({64, 64}).requires_grad_();
  int calls = 0;
  at::Tensor loss;
  {
    activation_scope scope(manager);
    loss = checkpoint([&](const std::vector<at::Tensor>& in) {
             ++calls;
             return in[0].repeat({calls, 1}).exp();
           }, {x}).sum();
  }
  CHECK(manager->stats().drops > 0);
  try {
    loss.backward();
    FAIL("no error");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("not deterministic") != std::string::npos);
  }
}

TEST_CASE("bad options name the value") {
  CHECK_THROWS_WITH_AS(parse_activation_mode("copy"),
                       "spillway.activations: mode 'copy' is invalid: expected one of hybrid, spill, drop",
                       spillway::invalid_argument);
  CHECK_THROWS_AS(parse_activation_policy("mru"), spillway::invalid_argument);
  activation_options o;
  o.link_bandwidth = 0;
  CHECK_THROWS_WITH_AS(activation_manager::make(o),
                       "spillway.activations: link_bandwidth 0.000000 is invalid: expected bytes "
                       "per second > 0, or none (Python: None) to measure it",
                       spillway::invalid_argument);
  o.link_bandwidth = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(activation_manager::make(o), spillway::invalid_argument);
  o.link_bandwidth = 1e30;  // valid, past what a counter holds: stats saturate, and list it
  const activation_stats huge = activation_manager::make(o)->stats();
  CHECK(huge.spill_bytes_per_s == std::numeric_limits<std::uint64_t>::max());
  bool listed = false;
  for (const auto& [name, value] : huge.fields()) listed |= name == "spill_bytes_per_s";
  CHECK(listed);
  activation_stats totals = activation_manager::totals();
  for (const auto& [name, value] : totals.fields()) CHECK(name != "spill_bytes_per_s");
  auto m = activation_manager::make({});
  CHECK_THROWS_AS(m->end_segment(0), spillway::invalid_argument);
  // A segment is its thread's: another thread cannot end it, and its own still can.
  m->begin_segment([](const std::vector<at::Tensor>&, std::optional<std::size_t>) { return segment_run{}; },
                   {}, {});
  std::thread([&] {
    CHECK_THROWS_WITH_AS(m->end_segment(0), doctest::Contains("on this thread"),
                         spillway::invalid_argument);
  }).join();
  m->end_segment(0);
}

TEST_CASE("a replay never refills another storage that took the address of one it saved") {
  // Segment 1 saves a and b; a's handle and tensor go, so its StorageImpl is freed. c, saved by
  // segment 2, is made until its StorageImpl lands at a's old address (as malloc often does at
  // once). b and c are dropped. Recomputing segment 1 (for b) must not take c for a and refill it
  // with segment 1's bytes: c must come back from its own segment.
  auto manager = activation_manager::make(drop_when_asked());
  constexpr std::int64_t n = 1024;
  auto replay_of = [](std::vector<float> values) {
    return [values](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
      segment_run out;
      for (float v : values) out.saved.push_back(at::full({n}, v));
      return out;
    };
  };
  manager->begin_segment(replay_of({1.0f, 2.0f}), {}, {});
  std::shared_ptr<activation_manager::saved> ha, hb, hc;
  const c10::StorageImpl* address_of_a = nullptr;
  {
    at::Tensor a = at::full({n}, 1.0f), b = at::full({n}, 2.0f);
    address_of_a = a.storage().unsafeGetStorageImpl();
    ha = manager->pack(a);
    hb = manager->pack(b);
  }
  manager->end_segment(1e-3);
  ha.reset();  // a is gone

  std::vector<at::Tensor> tries;
  at::Tensor c;
  for (int i = 0; i < 1000 && !c.defined(); ++i) {
    at::Tensor t = at::full({n}, 3.0f);
    if (t.storage().unsafeGetStorageImpl() == address_of_a) {
      c = t;
    } else {
      tries.push_back(t);
    }
  }
  tries.clear();
  const bool reused = c.defined();
  if (!reused) {
    MESSAGE("no StorageImpl took a's address (the weak reference keeps it, or malloc did not "
            "reuse it): the case reduces to two independent segments");
    c = at::full({n}, 3.0f);
  }
  manager->begin_segment(replay_of({3.0f}), {}, {});
  hc = manager->pack(c);
  manager->end_segment(1e-3);
  c.reset();
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 2 * n * sizeof(float));

  at::Tensor got_b = manager->unpack(*hb);
  CHECK(at::equal(got_b, at::full({n}, 2.0f)));
  CHECK(manager->state_of(got_b) == std::optional<std::string>("resident"));
  at::Tensor got_c = manager->unpack(*hc);
  CHECK(at::equal(got_c, at::full({n}, 3.0f)));
  CHECK(manager->stats().recomputes == 2);  // each segment replayed for its own storage
}

TEST_CASE("a replay that saves one storage where the first run saved two refills both") {
  // The first run saved a and b, two storages of one size; the replay saves one storage twice
  // (two tensors over it). The first entry takes over the replay's memory; the second must
  // get a copy of it, not the memory the first took (which left the replay's storage empty). And
  // a tensor the replay returns that something else still holds keeps its memory: it is copied.
  auto manager = activation_manager::make(drop_when_asked());
  constexpr std::int64_t n = 1024;
  const at::Tensor kept = at::full({n}, 7.0f);
  manager->begin_segment([kept](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
    at::Tensor t = at::full({n}, 5.0f);
    at::Tensor alias = at::empty({0}).set_(t.storage(), 0, {n}, {1});  // no view base: 2 owners
    return segment_run{{t, alias, kept}, {}};
  }, {}, {});
  std::shared_ptr<activation_manager::saved> ha, hb, hc;
  {
    at::Tensor a = at::full({n}, 5.0f), b = at::full({n}, 5.0f), c = at::full({n}, 7.0f);
    ha = manager->pack(a);
    hb = manager->pack(b);
    hc = manager->pack(c);
  }
  manager->end_segment(1e-3);
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 3 * n * sizeof(float));
  at::Tensor a = manager->unpack(*ha);
  at::Tensor b = manager->unpack(*hb);
  at::Tensor c = manager->unpack(*hc);
  CHECK(manager->stats().recomputes == 1);
  CHECK(manager->stats().recompute_moves == 1);
  REQUIRE(a.storage().data() != nullptr);
  REQUIRE(b.storage().data() != nullptr);
  CHECK(a.storage().data() != b.storage().data());
  CHECK(at::equal(a, at::full({n}, 5.0f)));
  CHECK(at::equal(b, at::full({n}, 5.0f)));
  CHECK(at::equal(c, at::full({n}, 7.0f)));
  REQUIRE(kept.storage().data() != nullptr);
  CHECK(kept.storage().data() != c.storage().data());
  CHECK(at::equal(kept, at::full({n}, 7.0f)));
}

TEST_CASE("a storage refilled by a copy is allocated once") {
  // As above, with the saved storages' memory from a counting allocator: b and c are refilled by
  // copies, a takes the replay's memory. A view made before the storage has its size again
  // resized it, allocating twice (the first block freed at once: twice the memory at that moment).
  struct counting final : c10::Allocator {
    int calls = 0;
    c10::DataPtr allocate(std::size_t n) override {
      ++calls;
      return c10::GetDefaultCPUAllocator()->allocate(n);
    }
    c10::DeleterFnPtr raw_deleter() const override { return c10::GetDefaultCPUAllocator()->raw_deleter(); }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
      std::memcpy(dest, src, count);
    }
  } memory;
  constexpr std::int64_t n = 1024;
  const auto counted = [&memory](float value) {
    c10::Storage st(c10::Storage::use_byte_size_t(), n * sizeof(float), &memory, /*resizable=*/true);
    return at::empty({0}).set_(st, 0, {n}, {1}).fill_(value);
  };
  auto manager = activation_manager::make(drop_when_asked());
  const at::Tensor kept = at::full({n}, 7.0f);
  manager->begin_segment([kept](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
    at::Tensor t = at::full({n}, 5.0f);
    at::Tensor alias = at::empty({0}).set_(t.storage(), 0, {n}, {1});
    return segment_run{{t, alias, kept}, {}};
  }, {}, {});
  std::shared_ptr<activation_manager::saved> ha, hb, hc;
  {
    at::Tensor a = counted(5.0f), b = counted(5.0f), c = counted(7.0f);
    ha = manager->pack(a);
    hb = manager->pack(b);
    hc = manager->pack(c);
  }
  manager->end_segment(1e-3);
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 3 * n * sizeof(float));
  memory.calls = 0;
  at::Tensor a = manager->unpack(*ha);
  at::Tensor b = manager->unpack(*hb);
  at::Tensor c = manager->unpack(*hc);
  CHECK(manager->stats().recompute_moves == 1);
  CHECK(memory.calls == 2);  // b's and c's blocks, once each
  CHECK(at::equal(b, at::full({n}, 5.0f)));
  CHECK(at::equal(c, at::full({n}, 7.0f)));
}

TEST_CASE("a resident storage of a segment may be evicted while that segment is replayed") {
  // The replay reads only the segment's inputs: its other storages need not stay resident for it
  // (they did, pinned: memory a replay under pressure could not use). One evicted meanwhile is
  // refilled from the replay like the dropped ones.
  auto manager = activation_manager::make(drop_when_asked());
  constexpr std::int64_t n = 1024;
  activation_manager* m = manager.get();  // not a shared_ptr: the segment would keep it alive
  manager->begin_segment([m](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
    m->evict(std::size_t{1} << 30);  // pressure in the middle of the replay
    return segment_run{{at::full({n}, 1.0f), at::full({n}, 2.0f)}, {}};
  }, {}, {});
  std::shared_ptr<activation_manager::saved> ha, hb;
  at::Tensor b;
  {
    at::Tensor a = at::full({n}, 1.0f);
    b = at::full({n}, 2.0f);
    ha = manager->pack(a);
    hb = manager->pack(b);
  }
  manager->end_segment(1e-3);
  REQUIRE(manager->evict(std::size_t{1} << 30).first == n * sizeof(float));  // a: b is held
  b.reset();
  at::Tensor got_a = manager->unpack(*ha);
  CHECK(at::equal(got_a, at::full({n}, 1.0f)));
  CHECK(manager->stats().drops == 2);  // b too, during the replay
  at::Tensor got_b = manager->unpack(*hb);
  CHECK(at::equal(got_b, at::full({n}, 2.0f)));
  CHECK(manager->stats().recomputes == 1);  // b was refilled by the same replay
}

TEST_CASE("with more candidates than are weighed, a sample of them is: what is asked is freed") {
  // Above 256 candidates each victim is chosen from a uniform sample of 256 (every one was
  // weighed: 3 ms a pressure call at 8,000). Eviction still frees what it is asked for, never a
  // storage the program holds, and every storage comes back.
  activation_options o;
  o.mode = activation_mode::spill;
  o.min_bytes = 0;
  auto manager = activation_manager::make(o);
  constexpr std::int64_t n = 256;  // floats: 1 KiB storages
  constexpr std::size_t storages = 1000;
  std::vector<std::shared_ptr<activation_manager::saved>> handles;
  std::vector<at::Tensor> held;  // every tenth, which the program keeps using
  for (std::size_t i = 0; i < storages; ++i) {
    at::Tensor t = at::full({n}, static_cast<float>(i));
    handles.push_back(manager->pack(t));
    if (i % 10 == 0) held.push_back(t);
  }
  const std::size_t bytes = n * sizeof(float);
  CHECK(manager->evict(300 * bytes).first == 300 * bytes);
  CHECK(manager->stats().spills == 300);
  for (const at::Tensor& t : held) CHECK(manager->state_of(t) == std::optional<std::string>("resident"));
  CHECK(manager->evict(std::size_t{1} << 30).first == (storages - held.size() - 300) * bytes);
  for (std::size_t i = 0; i < storages; ++i) {
    CHECK(at::equal(manager->unpack(*handles[i]), at::full({n}, static_cast<float>(i))));
  }
}

TEST_CASE("without host memory for a spill, a storage is dropped if it can be, else kept") {
  // max_spilled = 0: no spill can be made. In hybrid mode the checkpoint segments' storages are
  // dropped instead of spilled and the others stay resident; in spill mode nothing is evicted.
  // Either way training is bit-identical: nothing is lost.
  enable_libtorch_hooks();
  const result reference = train_step(nullptr, true);
  for (activation_mode mode : {activation_mode::hybrid, activation_mode::spill}) {
    CAPTURE(static_cast<int>(mode));
    activation_options o = evict_all(mode);
    o.link_bandwidth = 1e30;  // every spill is cheaper than its recompute: hybrid would spill
    o.max_spilled = 0;
    auto manager = activation_manager::make(o);
    check_identical(train_step(manager, true), reference);
    const activation_stats s = manager->stats();
    CHECK(s.spills == 0);
    CHECK(s.spill_fallbacks > 0);
    if (mode == activation_mode::hybrid) {
      CHECK(s.drops > 0);
      CHECK(s.recomputes > 0);
    } else {
      CHECK(s.evictions == 0);
    }
  }
  // A cap of one storage's bytes: spills up to it, then falls back.
  activation_options o = evict_all(activation_mode::spill);
  o.max_spilled = 128 * 1024;  // 128 KiB: one 256 x 128 float activation
  auto manager = activation_manager::make(o);
  check_identical(train_step(manager, true), reference);
  CHECK(manager->stats().spills > 0);
  CHECK(manager->stats().spill_fallbacks > 0);
}

TEST_CASE("a host allocation that fails is a spill not made, never a storage lost") {
  // The host allocator of spilled copies fails from its third allocation on: two spills are
  // made, then every other one falls back (hybrid: the segment's storages are dropped; spill:
  // kept resident). Training stays bit-identical.
  struct failing_host final : c10::Allocator {
    int left = 2;
    c10::DataPtr allocate(std::size_t n) override {
      if (left-- <= 0) throw std::bad_alloc();
      return c10::GetDefaultCPUAllocator()->allocate(n);
    }
    c10::DeleterFnPtr raw_deleter() const override {
      return c10::GetDefaultCPUAllocator()->raw_deleter();
    }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
      std::memcpy(dest, src, count);
    }
  };
  enable_libtorch_hooks();
  const result reference = train_step(nullptr, true);
  for (activation_mode mode : {activation_mode::hybrid, activation_mode::spill}) {
    CAPTURE(static_cast<int>(mode));
    failing_host host;
    activation_options o = evict_all(mode);
    o.link_bandwidth = 1e30;  // hybrid would spill everything it can
    o.host_allocator = &host;
    auto manager = activation_manager::make(o);
    check_identical(train_step(manager, true), reference);
    const activation_stats s = manager->stats();
    CHECK(s.spills == 2);
    CHECK(s.spill_fallbacks > 0);
    CHECK(s.restores == 2);
    if (mode == activation_mode::hybrid) CHECK(s.drops > 0);
    if (mode == activation_mode::spill) CHECK(s.drops == 0);
  }
}
