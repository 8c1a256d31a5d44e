// test_libtorch_restores: how the activation_manager restores dropped storages through the
// LibTorch route (libtorch_activations.hpp), on CPU tensors: the segments a replay needs first
// (every dropped input, in a loop, each needed segment once, what one restores for another held
// until it has run), the limit on replays nested in replays, and the early stop of a replay once
// it has given back every save that is still wanted.
#include "torch_doctest.hpp"  // ATen and doctest
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "libtorch_activation_options.hpp"
#include "libtorch_activations.hpp"

using namespace spillway::torch_plugin;
using spillway::test::drop_when_asked;
using spillway::test::evict_all;

namespace {

// The sum of `fn` on w * 3, run as one checkpoint segment in a scope of `manager` (without one,
// as it is).
at::Tensor segment_loss(const segment_function& fn, const at::Tensor& w,
                        const std::shared_ptr<activation_manager>& manager) {
  std::optional<activation_scope> scope;
  if (manager) scope.emplace(manager);
  return (manager ? checkpoint(fn, {w * 3}) : fn({w * 3})).sum();
}

}  // namespace

TEST_CASE("every dropped input of a segment is restored before it, in a loop, not by nesting") {
  // A ladder: S_i(z_i, prev), with z_i the output of a segment Z_i that ended just before, and
  // prev, S_(i-1)'s output, registered first by an op outside any segment (so it has S_(i-1) as
  // lineage). Replaying S_n needs both inputs, and so on down to S_0. Following only each
  // segment's first dropped input (as make_resident did) restored every prev from inside the
  // replay that needed it: 70 rungs nested 70 deep, over the limit of 64.
  enable_libtorch_hooks();
  const auto make_z = [](const std::vector<at::Tensor>& in) { return in[0].sin(); };
  const auto combine = [](const std::vector<at::Tensor>& in) { return (in[0] + in[1]).cos(); };
  const at::Tensor w0 = at::randn({1024});
  constexpr int rungs = 70;
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    at::Tensor loss;
    {
      std::optional<activation_scope> scope;
      if (manager) scope.emplace(manager);
      const auto segment = [&](const segment_function& fn, const std::vector<at::Tensor>& in) {
        return manager ? checkpoint(fn, in) : fn(in);
      };
      at::Tensor prev = w * 3, side = at::zeros({1024});
      for (int i = 0; i < rungs; ++i) {
        const at::Tensor z = segment(make_z, {w + i});
        prev = segment(combine, {z, prev});
        side = side + prev.square();  // saves prev outside a segment: its lineage is S_i
      }
      loss = prev.sum() + side.sum();
    }
    // Drop mode keeps what has no lineage (w * 3, each w + i) and drops everything else.
    if (manager) {
      manager->evict(std::size_t{1} << 30);
      REQUIRE(manager->stats().dropped_bytes > 0);
    }
    loss.backward();
    return w.grad();
  };
  const at::Tensor reference = run(nullptr);
  SUBCASE("evicted once, before the backward") {
    auto manager = activation_manager::make(drop_when_asked());
    CHECK(at::equal(run(manager), reference));
    const activation_stats s = manager->stats();
    CHECK(s.recomputes == 2 * rungs);             // each segment once
    CHECK(s.nested_recomputes == 2 * rungs - 1);  // all but S_69, for another's inputs
    CHECK(s.registered == 0);
  }
  SUBCASE("evicted whenever it can be (max_resident 0): polynomial, not exponential") {
    // Each backward step finds the chain below it dropped again and replays it: about rungs^2
    // replays (9,940). A restore that let go of what it had just replayed before the replay that
    // reads it ran (7318606) saw it evicted at the next unpack and walked the chain again: 2,502
    // replays at 8 rungs, not done in 12 minutes at 70 (found by review).
    auto manager = activation_manager::make(evict_all(activation_mode::drop));
    CHECK(at::equal(run(manager), reference));
    const activation_stats s = manager->stats();
    CHECK(s.recomputes <= 4 * rungs * rungs);
    CHECK(s.registered == 0);
  }
}

TEST_CASE("a chain of segments of two outputs is restored in linear time under pressure") {
  // Each segment takes the two outputs of the one before. A restore under max_resident 0 that
  // held, of a replay's outputs, only the one its reader unpacked first saw the other evicted at
  // that unpack, and replayed the segment again, and the chain below it: 4,095 replays for 12
  // segments (2^12 - 1; found by review). Every output a frame reads later is held now.
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  constexpr int segments = 12;
  const auto fn = [](const std::vector<at::Tensor>& in, std::optional<std::size_t> = {}) {
    return segment_run{{}, {(in[0] + in[1]).sin(), (in[0] - in[1]).cos()}};
  };
  at::Tensor a = at::randn({256}), b = at::randn({256});
  at::Tensor ra = a.clone(), rb = b.clone();
  for (int i = 0; i < segments; ++i) {
    manager->begin_segment(fn, {}, {a, b});
    segment_run first = fn({a, b});
    manager->end_segment(1e-3, first.outputs);
    a = first.outputs[0];
    b = first.outputs[1];
    segment_run reference = fn({ra, rb});
    ra = reference.outputs[0];
    rb = reference.outputs[1];
  }
  auto handle = manager->pack(a);
  a.reset();
  b.reset();
  manager->evict(std::size_t{1} << 30);
  REQUIRE(manager->stats().dropped_bytes > 0);
  CHECK(at::equal(manager->unpack(*handle), ra));
  CHECK(manager->stats().recomputes <= segments);  // each once at most
}

TEST_CASE("an output that a later frame of the same restore reads is held until that frame runs") {
  // P(x, y) returns a and b; A(a) returns a2, B(b) returns b2, T(a2, b2) returns t. Restoring t
  // pushes T, then A (for a2), then P (for a). P's replay restores a and b, but only A, on the
  // stack, reads a: B, which reads b, is pushed only after A has run. A restore that held only
  // what frames on the stack read let b go; pressure (max_resident 0) dropped it during A's
  // replay, and B's frame replayed P a second time (found by review).
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  const auto two = [](const std::vector<at::Tensor>& in, std::optional<std::size_t> = {}) {
    return segment_run{{}, {(in[0] + in[1]).sin(), (in[0] - in[1]).cos()}};
  };
  const auto one = [](const std::vector<at::Tensor>& in, std::optional<std::size_t> = {}) {
    at::Tensor sum = in[0];
    for (std::size_t j = 1; j < in.size(); ++j) sum = sum * in[j];
    return segment_run{{}, {sum.exp()}};
  };
  // Each output is registered right after its segment (as autograd's saves outside segments
  // are), so that its lineage is that segment.
  std::vector<std::shared_ptr<activation_manager::saved>> handles;
  const auto run_segment = [&](const segment_replay& fn, const std::vector<at::Tensor>& in) {
    manager->begin_segment(fn, {}, in);
    segment_run first = fn(in, std::nullopt);
    manager->end_segment(1e-3, first.outputs);
    for (const at::Tensor& out : first.outputs) handles.push_back(manager->pack(out));
    return first.outputs;
  };
  const at::Tensor x = at::randn({256}), y = at::randn({256});
  {
    const std::vector<at::Tensor> ab = run_segment(two, {x, y});
    const at::Tensor a2 = run_segment(one, {ab[0]})[0];
    const at::Tensor b2 = run_segment(one, {ab[1]})[0];
    run_segment(one, {a2, b2});
  }
  const std::vector<at::Tensor> reference_ab = two({x, y}).outputs;
  const at::Tensor reference =
      one({one({reference_ab[0]}).outputs[0], one({reference_ab[1]}).outputs[0]}).outputs[0];
  manager->evict(std::size_t{1} << 30);
  REQUIRE(manager->stats().drops == 5);  // every output
  CHECK(at::equal(manager->unpack(*handles.back()), reference));
  CHECK(manager->stats().recomputes == 4);  // P, A, B and T, each once
  handles.clear();
  CHECK(manager->stats().registered == 0);
}

TEST_CASE("a dense block (each segment reads every earlier one) is restored bit-identically") {
  // Segment k reads the outputs of segments 0..k-1, each registered by an op outside any
  // segment right after its own segment (so each has lineage), and every one is dropped as soon
  // as it can be (max_resident 0). Each backward step replays the block below it, each segment
  // once: about layers^2 replays in all (1,640). DTR's cost of a drop counts each needed segment
  // once too. It counted every path, up to 8 back: with 40 layers this test ran for over two
  // minutes before it was killed (the 2-core machine, 2026-11-27); now it takes about a second.
  // A restore that let go of what it had just replayed before its reader ran (7318606) made
  // 22,960 replays here.
  enable_libtorch_hooks();
  constexpr int layers = 40;
  const auto layer = [](const std::vector<at::Tensor>& in) {
    at::Tensor sum = in[0];
    for (std::size_t j = 1; j < in.size(); ++j) sum = sum + in[j];
    return (sum / static_cast<double>(in.size())).sin();
  };
  const at::Tensor w0 = at::randn({1024});
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    at::Tensor loss;
    {
      std::optional<activation_scope> scope;
      if (manager) scope.emplace(manager);
      std::vector<at::Tensor> features{w * 3};
      at::Tensor side = at::zeros({1024});
      for (int k = 0; k < layers; ++k) {
        features.push_back(manager ? checkpoint(layer, features) : layer(features));
        side = side + features.back().square();  // registers it: its lineage is segment k
      }
      loss = features.back().sum() + side.sum();
    }
    loss.backward();
    return w.grad();
  };
  const at::Tensor reference = run(nullptr);
  auto manager = activation_manager::make(evict_all(activation_mode::drop));
  CHECK(at::equal(run(manager), reference));
  CHECK(manager->stats().drops > 0);
  CHECK(manager->stats().recomputes > 0);
  CHECK(manager->stats().recomputes <= 2 * layers * layers);
  CHECK(manager->stats().registered == 0);
}

TEST_CASE("replays nested more than 64 deep fail clearly, and leave nothing pinned") {
  // Each segment's replay reads a storage of the one before that is not its input (the API
  // allows it; spillway's bindings pass what a segment reads as inputs): the walk over inputs
  // cannot see it, so every replay restores the one before from inside itself.
  auto manager = activation_manager::make(drop_when_asked());
  activation_manager* m = manager.get();  // raw: a segment holding the manager would keep it
  constexpr int segments = 70;
  constexpr std::int64_t n = 256;
  std::vector<std::shared_ptr<activation_manager::saved>> handles;
  handles.reserve(segments);
  const auto* before = &handles;  // the replays read it: raw, no handle held by a segment
  for (int i = 0; i < segments; ++i) {
    manager->begin_segment([m, before, i](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
      if (i > 0) {
        const at::Tensor previous = m->unpack(*(*before)[i - 1]);
        REQUIRE(at::equal(previous, at::full({n}, float(i - 1))));
      }
      return segment_run{{at::full({n}, float(i))}, {}};
    }, {}, {});
    handles.push_back(manager->pack(at::full({n}, float(i))));
    manager->end_segment(1e-3);
  }
  REQUIRE(manager->evict(std::size_t{1} << 30).first == segments * n * sizeof(float));

  std::string message;
  try {
    manager->unpack(*handles.back());
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  CHECK(message.find("replays nested 65 deep, over the limit of 64") != std::string::npos);
  // The unwound levels refilled nothing and let go of every member: all stay dropped, and one
  // within the limit is recomputed, bit-identically.
  CHECK(manager->stats().resident_bytes == 0);
  CHECK(manager->stats().dropped_bytes == segments * n * sizeof(float));
  CHECK(at::equal(manager->unpack(*handles[9]), at::full({n}, 9.0f)));
  CHECK(manager->stats().recomputes == 10);
  handles.clear();
  CHECK(manager->stats().registered == 0);
}

TEST_CASE("a replay stops after the last save backward still needs (early stop)") {
  // backward consumes a segment's saves last op first. Here the first op's save alone is dropped
  // (LRU drops the oldest), so the replay that restores it has nothing to give after it: it
  // stops there, and the ops after it (and their allocations) never run again.
  enable_libtorch_hooks();
  constexpr std::int64_t n = 4096;
  int tail_runs = 0;
  const auto chain = [&tail_runs](const std::vector<at::Tensor>& in) {
    const at::Tensor a = in[0].sin();  // saves in[0]
    const at::Tensor b = a.sin();      // saves a: the last save a replay has to give
    ++tail_runs;
    const at::Tensor c = b.sin();      // saves b
    return c.sin();                    // saves c
  };
  const at::Tensor w0 = at::randn({n});
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    const at::Tensor loss = segment_loss(chain, w, manager);
    if (manager) {
      // w * 3 has no lineage (it is kept); a, b and c do: the oldest, a, goes.
      REQUIRE(manager->evict(n * sizeof(float)).first == n * sizeof(float));
      REQUIRE(manager->stats().dropped_bytes == n * sizeof(float));
    }
    loss.backward();
    return w.grad();
  };
  const at::Tensor reference = run(nullptr);
  tail_runs = 0;
  auto manager = activation_manager::make(drop_when_asked(activation_policy::lru));
  CHECK(at::equal(run(manager), reference));
  const activation_stats s = manager->stats();
  CHECK(s.recomputes == 1);
  CHECK(s.recomputes_stopped == 1);
  CHECK(tail_runs == 1);  // the forward's; the replay stopped before it
  CHECK(s.registered == 0);
}

TEST_CASE("a stopped replay refills what it gave; what it dropped past the stop comes back later") {
  auto manager = activation_manager::make(drop_when_asked(activation_policy::lru));
  activation_manager* m = manager.get();  // raw: a segment holding the manager would keep it
  constexpr std::int64_t n = 1024;
  constexpr std::size_t bytes = n * sizeof(float);
  std::vector<std::optional<std::size_t>> asked;  // each replay's stop_after_saves
  manager->begin_segment([m, &asked](const std::vector<at::Tensor>&,
                                     std::optional<std::size_t> stop_after) {
    asked.push_back(stop_after);
    if (asked.size() == 1) m->evict(std::size_t{1} << 30);  // pressure in the first replay
    segment_run run;
    for (float v : {1.0f, 2.0f, 3.0f}) {
      run.saved.push_back(at::full({n}, v));
      if (run.saved.size() == stop_after) {
        run.stopped = true;
        return run;
      }
    }
    run.outputs.push_back(at::full({n}, 4.0f));
    return run;
  }, {}, {});
  auto ha = manager->pack(at::full({n}, 1.0f));
  auto hb = manager->pack(at::full({n}, 2.0f));
  auto hc = manager->pack(at::full({n}, 3.0f));
  at::Tensor output = at::full({n}, 4.0f);
  manager->end_segment(1e-3, {output});
  auto hout = manager->pack(output);  // registered now: the segment is its lineage
  output.reset();

  SUBCASE("no output dropped: the replay stops after the last dropped save") {
    REQUIRE(manager->evict(bytes).first == bytes);  // a, the oldest
    const at::Tensor a = manager->unpack(*ha);
    CHECK(at::equal(a, at::full({n}, 1.0f)));
    REQUIRE(asked.size() == 1);
    CHECK(asked[0] == std::optional<std::size_t>{1});
    // b, c and the output were dropped by the pressure in that replay, past its stop: they stay
    // dropped, not filled from nothing, and the next replay (the last save wanted: no stop)
    // gives them back.
    CHECK(manager->stats().dropped_bytes == 3 * bytes);
    CHECK(at::equal(manager->unpack(*hc), at::full({n}, 3.0f)));
    REQUIRE(asked.size() == 2);
    CHECK(!asked[1].has_value());
    CHECK(at::equal(manager->unpack(*hb), at::full({n}, 2.0f)));
    CHECK(at::equal(manager->unpack(*hout), at::full({n}, 4.0f)));
    CHECK(asked.size() == 2);
    CHECK(manager->stats().recomputes == 2);
    CHECK(manager->stats().recomputes_stopped == 1);
  }
  SUBCASE("a dropped output: the replay runs to the end, since outputs come last") {
    REQUIRE(manager->evict(std::size_t{1} << 30).first == 4 * bytes);
    asked.push_back(std::nullopt);  // no pressure in the replay
    CHECK(at::equal(manager->unpack(*ha), at::full({n}, 1.0f)));
    REQUIRE(asked.size() == 2);
    CHECK(!asked[1].has_value());
    CHECK(manager->stats().dropped_bytes == 0);
    CHECK(manager->stats().recomputes_stopped == 0);
  }
  ha.reset();
  hb.reset();
  hc.reset();
  hout.reset();
  CHECK(manager->stats().registered == 0);
}

TEST_CASE("a stop that the segment's code catches is still a stop") {
  // The stop is a std::exception thrown from the pack hook. A segment that catches it and
  // returns something else (a fallback the first run never took) must not have that taken for
  // its run: the replay gives back the saves up to the stop only. The pressure in the replay
  // drops the saves after it, which retain_graph keeps for the second backward: taken from the
  // fallback's run they failed the size check (or, of the same sizes, would be wrong bytes).
  enable_libtorch_hooks();
  constexpr std::int64_t n = 4096;
  activation_manager* pressure = nullptr;  // set during the replay
  const auto body = [&pressure](const std::vector<at::Tensor>& in) {
    if (pressure != nullptr) pressure->evict(std::size_t{1} << 30);
    const at::Tensor a = in[0].sin();  // saves in[0]
    try {
      const at::Tensor b = a * a;      // saves a (twice): the stop is thrown here
      return b.sin().sin();
    } catch (const std::exception&) {
      return a.detach();               // never taken by the first run
    }
  };
  const at::Tensor w0 = at::randn({n});
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    const at::Tensor loss = segment_loss(body, w, manager);
    if (manager) {
      REQUIRE(manager->evict(n * sizeof(float)).first == n * sizeof(float));  // LRU: a's save
      pressure = manager.get();
    }
    loss.backward({}, /*retain_graph=*/true);
    pressure = nullptr;
    loss.backward();
    return w.grad();
  };
  const at::Tensor reference = run(nullptr);
  auto manager = activation_manager::make(drop_when_asked(activation_policy::lru));
  CHECK(at::equal(run(manager), reference));
  CHECK(manager->stats().recomputes_stopped == 1);
  CHECK(manager->stats().recomputes >= 2);  // then the saves after the stop, dropped by it
}

TEST_CASE("a segment that runs a backward itself is recomputed") {
  // A gradient penalty inside a segment: its replay runs that backward too, which unpacks what
  // the replay saved (it got an undefined tensor, and the backward failed).
  enable_libtorch_hooks();
  constexpr std::int64_t n = 4096;
  const auto penalised = [](const std::vector<at::Tensor>& in) {
    const at::Tensor h = in[0].sin();
    const at::Tensor g = torch::autograd::grad({h.sum()}, {in[0]}, {}, /*retain_graph=*/true,
                                               /*create_graph=*/true)[0];
    return (h * g).sin();
  };
  const at::Tensor w0 = at::randn({n});
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    const at::Tensor loss = segment_loss(penalised, w, manager);
    if (manager) REQUIRE(manager->evict(std::size_t{1} << 30).first > 0);
    loss.backward();
    return w.grad();
  };
  const at::Tensor reference = run(nullptr);
  auto manager = activation_manager::make(drop_when_asked());
  CHECK(at::equal(run(manager), reference));
  CHECK(manager->stats().recomputes == 1);
  CHECK(manager->stats().registered == 0);
}

TEST_CASE("a storage registered again is not refilled by the segment that saved it before") {
  // S saves x and y; x's handle goes, so its entry goes while S lives on through y. x is then
  // changed and saved again by T: a new entry, with T as its lineage. Replaying S for y must not
  // refill x's new entry with S's bytes (it did: 1.0 instead of 7.0).
  auto manager = activation_manager::make(drop_when_asked());
  constexpr std::int64_t n = 1 << 14;
  manager->begin_segment([](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
    return segment_run{{at::full({n}, 1.0f), at::full({n}, 2.0f)}, {}};
  }, {}, {});
  at::Tensor x = at::full({n}, 1.0f);
  auto hx = manager->pack(x);
  auto hy = manager->pack(at::full({n}, 2.0f));
  manager->end_segment(1e-3);
  hx.reset();
  x.fill_(7.0f);
  manager->begin_segment([](const std::vector<at::Tensor>&, std::optional<std::size_t>) {
    return segment_run{{at::full({n}, 7.0f)}, {}};
  }, {}, {});
  auto hx2 = manager->pack(x);
  manager->end_segment(1e-3);
  x.reset();
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 2 * n * sizeof(float));
  CHECK(at::equal(manager->unpack(*hy), at::full({n}, 2.0f)));
  CHECK(at::equal(manager->unpack(*hx2), at::full({n}, 7.0f)));
  CHECK(manager->stats().recomputes == 2);
}

namespace {
// CPU autocast to bfloat16 for a scope, as torch.autocast("cpu", torch.bfloat16) sets it.
struct cpu_autocast {
  bool was = at::autocast::is_autocast_enabled(at::kCPU);
  at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCPU);
  cpu_autocast() {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~cpu_autocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, was);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
};
}  // namespace

TEST_CASE("a segment run under autocast is replayed under it") {
  // Backward runs the replay outside the autocast block. In fp32 it would give other bytes: the
  // bfloat16 saves twice as large (a size mismatch), exp's fp32 output the same size with other
  // values (wrong gradients, no error).
  enable_libtorch_hooks();
  const at::Tensor w0 = at::randn({256, 64}) * 0.1, x0 = at::randn({1024, 64}) * 0.1;
  const auto run = [&](const std::shared_ptr<activation_manager>& manager) {
    at::Tensor w = w0.clone().requires_grad_();
    const segment_function fn = [&w](const std::vector<at::Tensor>& in) {
      return at::linear(in[0], w).to(at::kFloat).exp();
    };
    at::Tensor loss;
    {
      std::optional<activation_scope> scope;
      if (manager) scope.emplace(manager);
      at::Tensor y;
      {
        cpu_autocast casting;
        y = manager ? checkpoint(fn, {x0 * 3}) : fn({x0 * 3});
      }
      loss = y.sum();
    }
    if (manager) REQUIRE(manager->evict(std::size_t{1} << 30).first > 0);
    loss.backward();
    return w.grad().clone();
  };
  const at::Tensor reference = run(nullptr);
  auto manager = activation_manager::make(drop_when_asked());
  CHECK(at::equal(run(manager), reference));
  CHECK(manager->stats().recomputes == 1);
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));  // as the replay found it
}

TEST_CASE("state kept from a replay is put back when the replay fails") {
  // `keep` (BatchNorm-like state the segment updates in place) must not be updated twice: a
  // replay puts it back as it found it, also when it throws.
  enable_libtorch_hooks();
  bool fail = false;
  at::Tensor state = at::zeros({4});
  const segment_function fn = [&](const std::vector<at::Tensor>& in) {
    {
      at::NoGradGuard no_grad;
      state.add_(1);
    }
    if (fail) throw std::runtime_error("the segment failed");
    return in[0].sin().exp();  // exp saves its result: the segment's to recompute
  };
  auto manager = activation_manager::make(drop_when_asked());
  at::Tensor w = at::randn({1 << 14}).requires_grad_();
  at::Tensor loss;
  {
    activation_scope scope(manager);
    loss = checkpoint(fn, {w * 3}, {state}).sum();
  }
  REQUIRE(at::equal(state, at::ones({4})));
  REQUIRE(manager->evict(std::size_t{1} << 30).first > 0);
  fail = true;
  CHECK_THROWS_WITH(loss.backward(), doctest::Contains("the segment failed"));
  CHECK(at::equal(state, at::ones({4})));
}
