// test_libtorch_prefetch: how the activation_manager restores spilled storages ahead of their
// unpack (activation_manager.hpp, the prefetch), on CPU tensors through the LibTorch route.
//
// (Prefetch into the room a cap leaves, bit-identical training: test_libtorch_activations.cpp;
// into the room a budget leaves: test_libtorch_pressure.cpp.)
// Proves that a storage restored ahead keeps its host copy, so that evicting it again before its
// unpack copies nothing; that the kept copies count against max_spilled and go first, those
// unpacked soonest first, when a spill needs their room or its host allocation fails; that a
// changed version makes such an eviction an ordinary spill; that the prefetch depth halves once
// per loss and grows by one per unpack that waits, and does not back off for a storage let go
// unread; and that a segment's input only the segment holds is never restored ahead.
#include "torch_doctest.hpp"  // ATen and doctest
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <vector>

#include "libtorch_activations.hpp"

using namespace spillway::torch_plugin;

namespace {

// A spill-mode manager that registers every storage and restores `prefetch` ahead.
std::shared_ptr<activation_manager> spilling_manager(std::size_t prefetch, activation_options o = {}) {
  o.mode = activation_mode::spill;
  o.min_bytes = 0;
  o.prefetch = prefetch;
  return activation_manager::make(o);
}

}  // namespace

TEST_CASE("a storage restored ahead and evicted again before its unpack is not copied out again") {
  // Its host copy is kept until the unpack: the bytes are the same (nothing but the manager held
  // the storage), so the eviction frees the memory and copies nothing. Each of the 8 storages is
  // copied out once, however often the pressure takes back what was prefetched.
  auto manager = spilling_manager(3);
  constexpr std::int64_t n = 1 << 14;  // floats: 64 KiB storages
  constexpr std::size_t bytes = n * sizeof(float);
  std::vector<std::shared_ptr<activation_manager::saved>> handles;
  for (int i = 0; i < 8; ++i) handles.push_back(manager->pack(at::full({n}, float(i))));
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 8 * bytes);
  std::vector<at::Tensor> used;  // held, as autograd holds what a running node unpacked
  for (int i = 7; i >= 0; --i) {
    used.push_back(manager->unpack(*handles[i]));
    CHECK(at::equal(used.back(), at::full({n}, float(i))));
    // What that unpack prefetched (the depth backs off, but an unpack that waited restores one
    // ahead at least) is all there is to evict; each is evicted without a copy.
    const std::size_t kept = manager->stats().kept_host_bytes;
    CHECK((kept > 0) == (i > 0));
    CHECK(manager->evict(std::size_t{1} << 30).first == kept);
  }
  const activation_stats s = manager->stats();
  CHECK(s.spills == 8);
  CHECK(s.bytes_spilled == 8 * bytes);
  CHECK(s.clean_evictions > 0);
  CHECK(s.clean_evictions == s.prefetches_unused);
  CHECK(s.restores == 8 + s.clean_evictions);
  CHECK(s.kept_host_bytes == 0);  // every one was unpacked
  CHECK(s.spilled_bytes == 0);
}

// a and b (n floats each) spilled, then restored ahead by the unpack of c (c_floats, held by the
// program while a and b were evicted): a and b keep their host copies. Policy largest makes c
// the next victim.
struct kept_copies {
  static constexpr std::int64_t n = 1 << 14;
  static constexpr std::size_t bytes = n * sizeof(float);
  std::shared_ptr<activation_manager> manager;
  std::shared_ptr<activation_manager::saved> ha, hb, hc;
  std::int64_t c_floats;

  kept_copies(activation_options o, std::int64_t c) : c_floats(c) {
    o.policy = activation_policy::largest;
    manager = spilling_manager(2, o);
    ha = manager->pack(at::full({n}, 1.0f));
    hb = manager->pack(at::full({n}, 2.0f));
    at::Tensor held = at::full({c}, 3.0f);
    hc = manager->pack(held);
    REQUIRE(manager->evict(std::size_t{1} << 30).first == 2 * bytes);  // a and b: c is held
    held = at::Tensor();
    CHECK(at::equal(manager->unpack(*hc), at::full({c}, 3.0f)));  // prefetches b and a
    REQUIRE(manager->stats().spilled_bytes == 0);
    REQUIRE(manager->stats().kept_host_bytes == 2 * bytes);
  }
  void check_bytes() {
    CHECK(at::equal(manager->unpack(*ha), at::full({n}, 1.0f)));
    CHECK(at::equal(manager->unpack(*hb), at::full({n}, 2.0f)));
    CHECK(at::equal(manager->unpack(*hc), at::full({c_floats}, 3.0f)));
  }
};

TEST_CASE("the prefetch depth halves when what it restored is taken back, and grows when unpacks wait") {
  // Additive increase, multiplicative decrease: storages restored ahead and evicted unread halve
  // the depth, once between two unpacks however many go; each unpack that waits for its copy
  // back adds one, up to `prefetch`.
  auto manager = spilling_manager(4);
  constexpr std::int64_t n = 1 << 14;
  std::vector<std::shared_ptr<activation_manager::saved>> handles;
  for (int i = 0; i < 8; ++i) handles.push_back(manager->pack(at::full({n}, float(i))));
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 8 * n * sizeof(float));
  std::vector<at::Tensor> used;  // held, as autograd holds what a running node unpacked
  const auto unpack = [&](int i) {
    used.push_back(manager->unpack(*handles[i]));
    CHECK(at::equal(used.back(), at::full({n}, float(i))));
    return manager->stats();
  };
  activation_stats s = unpack(7);  // waited (the depth is at its cap): 6, 5, 4, 3 restored ahead
  CHECK(s.unpacks_waiting == 1);
  CHECK(s.prefetches == 4);
  CHECK(s.prefetch_depth == 4);
  manager->evict(std::size_t{1} << 30);  // all four taken back unread: one loss, 4 -> 2
  CHECK(manager->stats().prefetches_unused == 4);
  CHECK(manager->stats().prefetch_depth == 2);
  s = unpack(6);  // waited: 3; 5, 4, 3 ahead
  CHECK(s.unpacks_waiting == 2);
  CHECK(s.prefetches == 7);
  manager->evict(std::size_t{1} << 30);  // three taken back: 3 -> 1.5
  CHECK(manager->stats().prefetch_depth == 1);
  s = unpack(5);  // waited: 2.5; 4, 3 ahead
  CHECK(s.prefetches == 9);
  s = unpack(4);  // restored ahead, not waited for: the depth stays; 2, 1 ahead (3 is resident)
  CHECK(s.unpacks_waiting == 3);
  CHECK(s.prefetch_depth == 2);
  CHECK(s.prefetches == 11);
  for (int i = 3; i >= 0; --i) s = unpack(i);  // 0 ahead, then nothing is left spilled
  CHECK(s.unpacks_waiting == 3);
  CHECK(s.prefetches == 12);
  CHECK(s.prefetches_unused == 7);
  CHECK(s.restores == 8 + 7);  // each once, and again each one taken back
}

TEST_CASE("a storage restored ahead and let go unread counts as unused, and the depth stays") {
  // Autograd releases what a node it never ran saved (a branch outside the loss): restored ahead
  // for nothing, but no room ran out, so the depth does not back off. The depth is a manager's
  // own: totals() does not list it.
  auto manager = spilling_manager(2);
  constexpr std::int64_t n = 1 << 14;
  auto ha = manager->pack(at::full({n}, 1.0f));
  auto hb = manager->pack(at::full({n}, 2.0f));
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 2 * n * sizeof(float));
  CHECK(at::equal(manager->unpack(*hb), at::full({n}, 2.0f)));  // waited; a restored ahead
  REQUIRE(manager->stats().prefetches == 1);
  ha.reset();  // a's last handle: forgotten unread
  const activation_stats s = manager->stats();
  CHECK(s.prefetches_unused == 1);
  CHECK(s.prefetch_depth == 2);
  const auto listed = [](const activation_stats& st) {
    for (const auto& [name, value] : st.fields()) {
      if (name == "prefetch_depth") return true;
    }
    return false;
  };
  CHECK(listed(s));
  CHECK_FALSE(listed(activation_manager::totals()));
}

TEST_CASE("kept host copies count against max_spilled, and go first when a spill needs room") {
  // c's spill needs room under the cap: kept copies go, those unpacked soonest (packed last)
  // first, only as many as it needs; none when even all of them would not make room (then a and
  // b are evicted to the copies they kept, with no copy out).
  constexpr std::size_t bytes = kept_copies::bytes;
  struct cell {
    std::int64_t c_storages;  // c's size, in a's
    std::size_t cap;          // max_spilled, in a's
    std::size_t freed, kept, spilled;  // in a's, after evicting c's size
    std::uint64_t spills, clean, fallbacks;
  };
  for (const cell& k : {cell{3, 4, 3, 1, 3, 3, 0, 0}, cell{4, 4, 4, 0, 4, 3, 0, 0},
                        cell{4, 3, 2, 0, 2, 2, 2, 1}}) {
    CAPTURE(k.c_storages);
    CAPTURE(k.cap);
    activation_options o;
    o.max_spilled = k.cap * bytes;
    kept_copies t(o, k.c_storages * kept_copies::n);
    CHECK(t.manager->evict(static_cast<std::size_t>(k.c_storages) * bytes).first == k.freed * bytes);
    activation_stats s = t.manager->stats();
    CHECK(s.kept_host_bytes == k.kept * bytes);
    CHECK(s.spilled_bytes == k.spilled * bytes);
    CHECK(s.spills == k.spills);
    CHECK(s.clean_evictions == k.clean);
    CHECK(s.spill_fallbacks == k.fallbacks);
    CHECK(s.spilled_bytes + s.kept_host_bytes <= k.cap * bytes);
    if (k.kept == 1) {  // b's copy went (b is unpacked before a): a is evicted clean; b has no room
      CHECK(t.manager->evict(2 * bytes).first == bytes);
      s = t.manager->stats();
      CHECK(s.clean_evictions == 1);
      CHECK(s.spill_fallbacks == 1);
      // b stayed resident and a was the clean one: b's unpack restores nothing but a, ahead.
      CHECK(at::equal(t.manager->unpack(*t.hb), at::full({kept_copies::n}, 2.0f)));
      CHECK(t.manager->stats().restores == s.restores + 1);
      CHECK(t.manager->stats().prefetches == s.prefetches + 1);
    }
    t.check_bytes();
  }
}

TEST_CASE("a storage whose version changed since its restore is copied out again, not evicted clean") {
  // v shares a's version counter (detach) but not its storage (set_): an in-place change to v
  // bumps the version a's kept copy was taken at. The copy is no longer trusted: a's eviction
  // copies its bytes out again.
  auto manager = spilling_manager(1);
  constexpr std::int64_t n = 1 << 14;
  at::Tensor a = at::full({n}, 5.0f);
  at::Tensor v = a.detach();
  v.set_(at::zeros({n}));
  auto ha = manager->pack(a);
  at::Tensor c = at::full({n}, 6.0f);
  auto hc = manager->pack(c);
  a = at::Tensor();
  REQUIRE(manager->evict(std::size_t{1} << 30).first == n * sizeof(float));  // a: c is held
  c = at::Tensor();
  CHECK(at::equal(manager->unpack(*hc), at::full({n}, 6.0f)));  // prefetches a, keeping its copy
  REQUIRE(manager->stats().kept_host_bytes == n * sizeof(float));
  v.add_(1);
  CHECK(manager->evict(std::size_t{1} << 30).first == 2 * n * sizeof(float));  // a and c
  const activation_stats s = manager->stats();
  CHECK(s.clean_evictions == 0);
  CHECK(s.spills == 3);  // a twice, c once
  CHECK(s.kept_host_bytes == 0);
  CHECK(at::equal(manager->unpack(*ha), at::full({n}, 5.0f)));
}

TEST_CASE("a spill whose host allocation fails lets the kept host copies go and tries again") {
  // No cap: the host allocator itself fails once, as pinned memory runs out. The kept copies
  // (which a prefetch would otherwise have freed) go, and the spill is made.
  struct failing_once final : c10::Allocator {
    int fail = 0;
    c10::DataPtr allocate(std::size_t n) override {
      if (fail > 0) {
        --fail;
        throw std::bad_alloc();
      }
      return c10::GetDefaultCPUAllocator()->allocate(n);
    }
    c10::DeleterFnPtr raw_deleter() const override {
      return c10::GetDefaultCPUAllocator()->raw_deleter();
    }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
      std::memcpy(dest, src, count);
    }
  } host;
  activation_options o;
  o.host_allocator = &host;
  kept_copies t(o, 4 * kept_copies::n);
  host.fail = 1;
  CHECK(t.manager->evict(4 * kept_copies::bytes).first == 4 * kept_copies::bytes);
  const activation_stats s = t.manager->stats();
  CHECK(host.fail == 0);
  CHECK(s.spill_fallbacks == 0);
  CHECK(s.spills == 3);
  CHECK(s.kept_host_bytes == 0);
  t.check_bytes();
}

TEST_CASE("a segment's input that only the segment holds is not prefetched") {
  // exp saves its output, not its input: x is held by the segment alone, for a replay, which
  // spill mode never runs. Prefetching it in backward restored bytes nothing read (on CUDA they
  // then stayed resident, unevictable, to the step's end).
  enable_libtorch_hooks();
  activation_options options;
  options.mode = activation_mode::spill;
  options.min_bytes = 0;
  options.prefetch = 8;
  auto manager = activation_manager::make(options);
  at::Tensor w = at::randn({1 << 16}).requires_grad_();
  at::Tensor loss;
  {
    activation_scope scope(manager);
    at::Tensor h = checkpoint([](const std::vector<at::Tensor>& in) { return in[0].exp(); }, {w * 2});
    loss = h.sum();
  }
  REQUIRE(manager->evict(std::size_t{1} << 30).first == 2 * (std::size_t{1} << 18));  // x and h
  loss.backward();
  CHECK(at::allclose(w.grad(), 2 * (w.detach() * 2).exp()));
  const activation_stats s = manager->stats();
  CHECK(s.restores == 1);  // h, unpacked by exp's backward
  CHECK(s.prefetches == 0);
  CHECK(s.prefetches_unused == 0);
}
