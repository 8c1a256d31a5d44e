// test_engine_integrity: data stays bit-identical through 100,000 random engine operations.
//
// It proves: on a graph of buffers with lineage (chains, diamonds, multi-output nodes, and sources
// without lineage that can only spill) on two streams under a budget that keeps the engine
// evicting, random pins (on the buffer's stream or another), unpins, evictions (spill, drop,
// automatic), prefetches, over-budget allocations, forgets, new nodes, run_until_idle() and
// advance() of the simulated clock never change a buffer's bytes: each pin enqueues a kernel that
// checksums the bytes in stream order against the host's golden copy, and each recompute's kernel
// checks its inputs. Explicit evictions do what their mode says; out_of_memory is the only failure
// and stays rare; at the end every buffer is checked, and forgetting them all returns the
// allocator to zero with a snapshot that tiles its segments. Four seeds, one per policy.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

constexpr int k_cycles_per_seed = 25'000;  // x 4 seeds = 100,000

struct run_counts {
  std::uint64_t pins = 0, evicts = 0, ooms = 0, forgets = 0, nodes = 0, allocations = 0;
};

// The default: ~5 MiB of buffers under a 4 MiB budget, two small segments, one per stream.
// Compaction (Note [Compaction]) needs another segment on the same stream to move into: a budget
// of 8 MiB and 640 buffers give it two per stream, and `expect_moves` checks that it moved some.
struct run_shape {
  std::size_t budget = 4 * MiB;
  std::size_t buffers = 320;
  bool expect_moves = false;
};

class random_run {
 public:
  random_run(std::uint64_t seed, const std::string& policy, run_shape sh = {})
      : env_(options(seed, policy, sh.budget)), g_(env_), rng_(seed), shape_(sh) {
    streams_ = {stream_ref{}, env_.stream(0)};
    for (int i = 0; i < 24; ++i) {
      buffer_options o;
      o.evictable = i != 0;  // one that never moves
      live_.push_back(g_.source(size(), stream(), o));
      mode_of_[live_.back().value] = o.mode;
    }
    fixed_ = live_.front();
    while (live_.size() < shape_.buffers) add_node();
    env_.sim->run_until_idle();
  }

  void run(int cycles) {
    for (int i = 0; i < cycles; ++i) step();
    finish();
  }

  const run_counts& counts() const noexcept { return counts_; }

 private:
  static engine_options options(std::uint64_t seed, const std::string& policy, std::size_t budget) {
    engine_options o;
    o.budget = budget;
    o.streams = 1;
    o.engine.policy = policy;
    o.engine.seed = seed;
    return o;
  }

  std::size_t size() { return 512 * (1 + rng_() % 64); }  // 512 B .. 32 KiB
  stream_ref stream() { return streams_[rng_() % streams_.size()]; }
  template <class V>
  auto& pick(V& v) { return v[rng_() % v.size()]; }

  bool pinned(buffer_id id) const {
    const auto it = pins_of_.find(id.value);
    return it != pins_of_.end() && it->second > 0;
  }

  void add_node() {
    // Inputs: mostly recent buffers (chains), sometimes any (diamonds across the graph).
    std::vector<buffer_id> inputs;
    const std::size_t n_in = 1 + rng_() % 3;
    for (std::size_t k = 0; k < n_in; ++k) {
      const std::size_t back = rng_() % 2 == 0 ? rng_() % std::min<std::size_t>(8, live_.size())
                                               : rng_() % live_.size();
      inputs.push_back(live_[live_.size() - 1 - back]);
    }
    std::vector<std::size_t> outs{size()};
    if (rng_() % 5 == 0) outs.push_back(size());
    std::vector<buffer_options> opts(outs.size());
    for (auto& o : opts) {
      const int m = static_cast<int>(rng_() % 10);
      o.mode = m == 0 ? eviction_mode::spill : m == 1 ? eviction_mode::drop : eviction_mode::automatic;
    }
    const double cost = static_cast<double>(100 + rng_() % 1'000'000);
    try {
      const std::vector<buffer_id> ids = g_.node(inputs, outs, stream(), cost, opts);
      live_.insert(live_.end(), ids.begin(), ids.end());
      for (std::size_t k = 0; k < ids.size(); ++k) mode_of_[ids[k].value] = opts[k].mode;
      ++counts_.nodes;
    } catch (const out_of_memory&) {
      ++counts_.ooms;  // its inputs could not all be made resident, or no room for its outputs
    }
  }

  void step() {
    const int op = static_cast<int>(rng_() % 100);
    if (op < 26) {
      do_pin();
    } else if (op < 46) {
      if (!held_.empty()) unpin_one();
    } else if (op < 66) {
      do_evict();
    } else if (op < 73) {
      env_.eng().prefetch(pick(live_));
    } else if (op < 76) {
      env_.sim->run_until_idle();
    } else if (op < 86) {
      env_.sim->advance(rng_() % 20'000);
    } else if (op < 93) {
      do_allocate();
    } else if (op < 96) {
      if (!held_.empty()) {  // pinned: never evicted, whatever happened since
        const buffer_state s = env_.eng().state(pick(held_).id());
        CHECK((s == buffer_state::resident || s == buffer_state::restoring));
      }
    } else if (op < 98) {
      do_forget();
    } else {
      add_node();
    }
  }

  void do_pin() {
    if (held_.size() >= 6) unpin_one();
    const buffer_id id = pick(live_);
    const bool other = rng_() % 4 == 0;
    const stream_ref use = other ? stream() : g_.at(id).stream;
    try {
      pinned_buffer p = other ? env_.eng().pin(id, use) : env_.eng().pin(id);
      ++counts_.pins;
      ++pins_of_[id.value];
      g_.check_kernel(id, p.get(), use, {}, 100 + rng_() % 20'000);  // may outlive the pin
      if (rng_() % 64 == 0) {  // now, on the host, too
        env_.sim->synchronize_stream(use);
        CHECK_MESSAGE(checksum(p.get(), g_.at(id).bytes) == g_.at(id).sum, "buffer " << id.value);
      }
      held_.push_back(std::move(p));
    } catch (const out_of_memory&) {
      ++counts_.ooms;  // a restore or recompute that did not fit: the buffer is still evicted
      const buffer_state s = env_.eng().state(id);
      CHECK((s == buffer_state::spilled || s == buffer_state::spilling || s == buffer_state::dropped));
    }
  }

  void unpin_one() {
    const std::size_t k = rng_() % held_.size();
    --pins_of_[held_[k].id().value];
    held_[k] = std::move(held_.back());
    held_.pop_back();
  }

  void do_evict() {
    const buffer_id id = pick(live_);
    const int m = static_cast<int>(rng_() % 3);
    const eviction_mode mode =
        m == 0 ? eviction_mode::spill : m == 1 ? eviction_mode::drop : eviction_mode::automatic;
    if (pinned(id)) {
      CHECK_THROWS_AS(env_.eng().evict(id, mode), invalid_argument);
      return;
    }
    const buffer_state before = env_.eng().state(id);
    const bool evicted = env_.eng().evict(id, mode);
    const buffer_state after = env_.eng().state(id);
    ++counts_.evicts;
    const bool has_lineage = g_.at(id).node >= 0;
    const eviction_mode own = mode_of_.at(id.value);
    if (evicted) {
      CHECK(after != buffer_state::resident);
      CHECK(after != buffer_state::restoring);
      if (before == buffer_state::resident && mode == eviction_mode::drop) {
        CHECK(after == buffer_state::dropped);
      }
      if (before == buffer_state::resident && mode == eviction_mode::spill) {
        CHECK(after == buffer_state::spilling);
      }
    } else {
      CHECK((after == buffer_state::resident || after == buffer_state::restoring));
    }
    // What must succeed: a resident, evictable buffer evicted in a way its own mode allows and
    // it can be (drop needs lineage; the host pool is ample here).
    if (before == buffer_state::resident && id != fixed_) {
      if (mode == eviction_mode::drop && has_lineage && own != eviction_mode::spill) CHECK(evicted);
      if (mode == eviction_mode::spill && own != eviction_mode::drop) CHECK(evicted);
      if (mode == eviction_mode::drop && !has_lineage) CHECK_FALSE(evicted);
    }
    if (id == fixed_) CHECK_FALSE(evicted);
  }

  void do_allocate() {
    // Buffer-sized (to reuse what evictions free), or up to 512 KiB (to make room).
    const std::size_t bytes = rng_() % 2 == 0 ? size() : 16 * KiB * (1 + rng_() % 32);
    const stream_ref s = stream();
    try {
      void* p = env_.alloc->allocate(bytes, s);
      ++counts_.allocations;
      env_.sim->launch(s, 100, [p, bytes] { std::memset(p, 0x77, bytes); });
      env_.alloc->deallocate(p);  // stream-ordered: the next user on s comes after the kernel
    } catch (const out_of_memory&) {
      ++counts_.ooms;
    }
  }

  void do_forget() {
    if (live_.size() < 200) return;
    const std::size_t k = rng_() % live_.size();
    const buffer_id id = live_[k];
    if (pinned(id) || id == fixed_) return;
    env_.eng().forget(id);  // hidden when a node still needs it
    live_[k] = live_.back();
    live_.pop_back();
    ++counts_.forgets;
  }

  void finish() {
    held_.clear();
    pins_of_.clear();
    for (buffer_id id : live_) g_.expect(id);
    env_.sim->run_until_idle();
    env_.check_clean();
    const eviction::engine_stats st = env_.eng().stats();
    CHECK(st.registered == live_.size());
    CHECK(st.spills > 0);
    CHECK(st.drops > 0);
    CHECK(st.restores > 0);
    CHECK(st.recomputes > 0);
    CHECK(st.pressure_calls > 0);
    if (shape_.expect_moves) {
      CHECK(st.moves > 0);
      CHECK(st.segments_emptied > 0);
    }
    CHECK(counts_.ooms * 50 < counts_.pins + counts_.allocations);  // rare
    check_snapshot_invariants(env_.alloc->snapshot());
    for (buffer_id id : live_) env_.eng().forget(id);
    env_.sim->run_until_idle();
    CHECK(env_.eng().stats().registered == 0);
    CHECK(env_.allocated_bytes() == 0);
    const memory_snapshot snap = env_.alloc->snapshot();
    check_snapshot_invariants(snap);
    check_stats_match_snapshot(env_.alloc->stats(), snap);
    MESSAGE("pins " << counts_.pins << ", evicts " << counts_.evicts << ", spills " << st.spills
                    << ", drops " << st.drops << ", restores " << st.restores << ", recomputes "
                    << st.recomputes << ", moves " << st.moves << ", segments emptied "
                    << st.segments_emptied << ", ooms " << counts_.ooms << ", checks "
                    << env_.log.checks());
  }

  engine_env env_;
  lineage_graph g_;
  std::mt19937_64 rng_;
  std::vector<stream_ref> streams_;
  std::vector<buffer_id> live_;  // registered (not forgotten)
  buffer_id fixed_;              // registered as not evictable
  std::unordered_map<std::uint64_t, eviction_mode> mode_of_;
  std::vector<pinned_buffer> held_;
  std::unordered_map<std::uint64_t, int> pins_of_;
  run_shape shape_;
  run_counts counts_;
};

}  // namespace

TEST_CASE("100,000 random engine operations leave every buffer bit-identical") {
  const std::vector<std::string> policies = {"dtr-frag", "dtr", "lru", "largest"};
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const std::uint64_t seed = 0x1D7E6A17 + i;
    CAPTURE(seed);
    CAPTURE(policies[i]);
    random_run r(seed, policies[i]);
    r.run(k_cycles_per_seed);
  }
}

TEST_CASE("random engine operations with compaction: moved buffers stay bit-identical") {
  const std::vector<std::string> policies = {"dtr-frag", "lru"};
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const std::uint64_t seed = 0xC0A1E5CE + i;
    CAPTURE(seed);
    CAPTURE(policies[i]);
    random_run r(seed, policies[i], {.budget = 8 * MiB, .buffers = 640, .expect_moves = true});
    r.run(k_cycles_per_seed);
  }
}
