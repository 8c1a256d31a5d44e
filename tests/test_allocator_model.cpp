// test_allocator_model: randomized operations on the sim device, checked against a reference model.
//
// Each run (a seed, plain or expandable segments, budgeted or capacity-bound) draws thousands of
// operations: allocate, deallocate, record_stream (with kernels queued on the recorded stream),
// kernels, clock advances, empty_cache, set_budget; on three streams. After every operation it
// proves, from snapshot() and stats():
// - every byte of every segment belongs to exactly one block; blocks tile segments; no free block
//   has a free neighbour (allocator_checks.hpp);
// - the allocated blocks are exactly the model's live allocations: same address, the request's
//   size as requested_size, a block size that is the rounded request (or a block too small to
//   split), the pool and stream of the request;
// - a block waiting on other streams (pending) is one the model freed with record_stream, and it
//   leaves that state only after all kernels queued on those streams before the free completed;
// - statistics equal what the snapshot and the model's own counts say, every peak only grows, and
//   a reservation never takes reserved bytes over the budget; releasable_bytes() equals what the
//   snapshot says a release would give back, and partly_free_segments() the segments it shows
//   with live and free blocks and no pending ones;
// - out_of_memory is thrown only when no cached block fits and no new memory fits the budget or
//   the device; set_budget reports what it did and refuses budgets below live memory.
// Every allocation carries a pattern derived from its id, checked before it is freed (and all of
// them now and then): two blocks that overlap would corrupt each other's pattern.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"

using namespace spillway;
using namespace spillway::test;
namespace sc = spillway::size_classes;

namespace {

struct run_config {
  std::uint64_t seed = 1;
  bool expandable = false;
  bool budgets = true;                 // draw set_budget operations
  std::size_t capacity = 2048 * MiB;   // the sim device
  int steps = 2500;
};

struct live_allocation {
  std::uint64_t id = 0;
  std::size_t requested = 0;
  std::size_t rounded = 0;
  stream_ref stream;
  std::vector<stream_ref> uses;  // streams recorded with record_stream (not its own)
};

struct pending_block {
  std::size_t size = 0;
  std::size_t requested = 0;  // still counted in requested_bytes until the block is really free
  std::vector<std::pair<int, std::uint64_t>> fences;  // (stream index, kernels queued before free)
};

class model_run {
 public:
  explicit model_run(const run_config& rc) : rc_(rc), rng_(rc.seed) {
    sim_config s = default_sim_config();
    s.capacity = rc.capacity;
    env_ = make_sim_env(s);
    for (int i = 0; i < 3; ++i) streams_.push_back(env_->new_stream());
    allocator_config c = env_->config();
    c.expandable_segments = rc.expandable;
    alloc_ = std::make_unique<device_allocator>(env_->backend, c);
    completed_ = std::make_shared<std::vector<std::uint64_t>>(streams_.size(), 0);
    launched_.assign(streams_.size(), 0);
  }

  ~model_run() {
    // Everything is freed and the simulation drained before the allocator goes.
    for (auto& [address, a] : live_) alloc_->deallocate(reinterpret_cast<void*>(address));
    env_->sim->run_until_idle();
    alloc_.reset();
  }

  void run() {
    previous_ = alloc_->stats();
    for (step_ = 0; step_ < rc_.steps; ++step_) {
      const std::int64_t reserved_before = alloc_->stats().reserved_bytes[0].current;
      const int op = static_cast<int>(rng_() % 100);
      const bool crowded = live_.size() > 120;
      if (op < 42 && !crowded) {
        do_allocate();
      } else if (op < 72 || (crowded && op < 90)) {
        do_free();
      } else if (op < 82) {
        do_record_stream();
      } else if (op < 87) {
        do_launch(static_cast<int>(rng_() % streams_.size()));
      } else if (op < 94) {
        env_->sim->advance(rng_() % 400'000);
      } else if (op < 96) {
        do_empty_cache();
      } else if (op < 98) {
        if (rc_.budgets) do_set_budget();
      } else {
        env_->sim->run_until_idle();
      }
      check_step(reserved_before);
      if (step_ % 100 == 99) check_all_patterns();
    }
    // Drain: free everything, let every stream finish, release the cache.
    while (!live_.empty()) free_one(live_.begin()->first);
    env_->sim->run_until_idle();
    alloc_->set_budget(unlimited_budget);
    alloc_->empty_cache();
    check_step(alloc_->stats().reserved_bytes[0].current);
    const memory_stats st = alloc_->stats();
    CHECK(st.allocated_bytes[0].current == 0);
    CHECK(st.active_bytes[0].current == 0);
    CHECK(st.reserved_bytes[0].current == 0);
    CHECK(alloc_->snapshot().segments.empty());
    CHECK(pending_.empty());
    MESSAGE("seed " << rc_.seed << std::string(rc_.expandable ? " expandable" : " fixed") << ": " << allocs_
                    << " allocations, " << ooms_ << " out_of_memory, " << deferred_
                    << " deferred frees, " << budget_refusals_ << " refused budgets");
  }

  std::uint64_t allocations() const { return allocs_; }
  std::uint64_t ooms() const { return ooms_; }
  std::uint64_t deferred() const { return deferred_; }

 private:
  std::size_t draw_size() {
    const int k = static_cast<int>(rng_() % 100);
    if (k < 50) return 1 + rng_() % (64 * KiB);
    if (k < 75) return 64 * KiB + rng_() % (MiB - 64 * KiB + 1);
    if (k < 95) return MiB + 1 + rng_() % (11 * MiB);
    return 12 * MiB + rng_() % (28 * MiB);
  }

  void do_launch(int si) {
    ++launched_[static_cast<std::size_t>(si)];
    auto completed = completed_;
    env_->sim->launch(streams_[static_cast<std::size_t>(si)], rng_() % 300'000,
                      [completed, si] { ++(*completed)[static_cast<std::size_t>(si)]; });
  }

  void do_allocate() {
    const std::size_t n = draw_size();
    const int si = static_cast<int>(rng_() % streams_.size());
    const stream_ref s = streams_[static_cast<std::size_t>(si)];
    void* p = nullptr;
    try {
      p = alloc_->allocate(n, s);
    } catch (const out_of_memory& e) {
      ++ooms_;
      check_oom_is_legitimate(n, s, e);
      return;
    }
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    INFO("step " << step_ << ": allocate(" << n << ") = " << address);
    REQUIRE(live_.count(address) == 0);
    live_allocation a;
    a.id = ++next_id_;
    a.requested = n;
    a.rounded = sc::round_size(n);
    a.stream = s;
    fill_pattern(p, n, a.id);
    live_.emplace(address, std::move(a));
    ++allocs_;
    requested_total_ += n;
  }

  void do_free() {
    if (live_.empty()) return;
    auto it = live_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % live_.size()));
    free_one(it->first);
  }

  void free_one(std::uintptr_t address) {
    const live_allocation a = live_.at(address);
    void* p = reinterpret_cast<void*>(address);
    std::size_t bad = 0;
    INFO("step " << step_ << ": free " << address << " (id " << a.id << ", " << a.requested
                 << " bytes)");
    CHECK_MESSAGE(pattern_ok(p, a.requested, a.id, &bad),
                  "pattern overwritten at offset " << bad << ": another block overlaps this one");
    const std::size_t size = alloc_->describe(p).size;
    {
      // What it would coalesce into once pending frees complete: itself plus the run of free and
      // pending-free neighbours around it.
      const memory_snapshot snap = alloc_->snapshot();
      std::size_t expected = 0;
      for (const segment_info& seg : snap.segments) {
        for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
          if (seg.blocks[i].address != address) continue;
          expected = seg.blocks[i].size;
          for (std::size_t j = i; j > 0 && !seg.blocks[j - 1].allocated(); --j) {
            expected += seg.blocks[j - 1].size;
          }
          for (std::size_t j = i + 1; j < seg.blocks.size() && !seg.blocks[j].allocated(); ++j) {
            expected += seg.blocks[j].size;
          }
        }
      }
      CHECK(alloc_->coalesced_size_if_freed(p) == expected);
    }
    pending_block pb;
    pb.size = size;
    pb.requested = a.requested;
    for (stream_ref u : a.uses) {
      const int ui = stream_index(u);
      pb.fences.emplace_back(ui, launched_[static_cast<std::size_t>(ui)]);
    }
    const free_status st = alloc_->deallocate(p);
    CHECK(st == (a.uses.empty() ? free_status::freed : free_status::deferred));
    if (st == free_status::deferred) {
      ++deferred_;
      pending_[address] = std::move(pb);
    } else {
      requested_freed_ += a.requested;  // pending frees count once they are really free
    }
    live_.erase(address);
    ++frees_;
  }

  void do_record_stream() {
    if (live_.empty()) return;
    auto it = live_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % live_.size()));
    const int ui = static_cast<int>(rng_() % streams_.size());
    const stream_ref u = streams_[static_cast<std::size_t>(ui)];
    alloc_->record_stream(reinterpret_cast<void*>(it->first), u);
    live_allocation& a = it->second;
    if (u != a.stream && std::find(a.uses.begin(), a.uses.end(), u) == a.uses.end()) {
      a.uses.push_back(u);
    }
    if (rng_() % 2 == 0) do_launch(ui);  // the recorded stream uses the block
  }

  void do_empty_cache() {
    const std::int64_t before = alloc_->stats().reserved_bytes[0].current;
    const std::size_t released = alloc_->empty_cache();
    const std::int64_t after = alloc_->stats().reserved_bytes[0].current;
    CHECK(static_cast<std::int64_t>(released) == before - after);
    check_no_releasable_memory("after empty_cache");
  }

  void do_set_budget() {
    const std::size_t allocated = static_cast<std::size_t>(alloc_->stats().allocated_bytes[0].current);
    const int k = static_cast<int>(rng_() % 10);
    if (k == 0) {
      CHECK(alloc_->set_budget(unlimited_budget).met());
      return;
    }
    if (k == 1 && allocated > 2 * MiB) {  // below live memory: refused, the old budget stays
      const std::size_t old = alloc_->budget();
      const std::size_t ask = allocated / 2;
      CHECK_THROWS_AS(alloc_->set_budget(ask), spillway::invalid_argument);
      CHECK(alloc_->budget() == old);
      ++budget_refusals_;
      return;
    }
    const std::size_t ask = allocated + 512 + rng_() % (160 * MiB);
    const budget_report r = alloc_->set_budget(ask);
    const std::size_t reserved = static_cast<std::size_t>(alloc_->stats().reserved_bytes[0].current);
    CHECK(r.budget == ask);
    CHECK(alloc_->budget() == ask);
    CHECK(r.reserved == reserved);
    CHECK(r.shortfall == (reserved > ask ? reserved - ask : 0));
    if (!r.met()) check_no_releasable_memory("after a budget that was not met");
  }

  // What a release would give back, from the snapshot: each fixed segment that is one free
  // block, and the whole granules of each free block of an expandable one.
  std::size_t releasable_in(const memory_snapshot& snap) const {
    const std::size_t g = env_->backend->vmm_granularity();
    std::size_t bytes = 0;
    for (const segment_info& seg : snap.segments) {
      if (!seg.is_expandable) {
        if (seg.blocks.size() == 1 && !seg.blocks[0].active()) bytes += seg.total_size;
        continue;
      }
      for (const block_info& b : seg.blocks) {
        const std::size_t lo = sc::round_up(b.address, g);
        const std::size_t hi = (b.address + b.size) / g * g;
        if (!b.active() && hi > lo) bytes += hi - lo;
      }
    }
    return bytes;
  }

  // After a release (empty_cache, a trimmed budget), no fully free fixed segment is left, and no
  // free block of an expandable segment holds a whole granule.
  void check_no_releasable_memory(const char* when) {
    const std::size_t g = env_->backend->vmm_granularity();
    for (const segment_info& seg : alloc_->snapshot().segments) {
      INFO(std::string(when) << ": segment " << seg.address);
      const block_info& last = seg.blocks.back();
      if (seg.is_expandable) {
        for (const block_info& b : seg.blocks) {
          if (!b.active()) CHECK(sc::round_up(b.address, g) + g > b.address + b.size);
        }
      } else {
        CHECK_FALSE((seg.blocks.size() == 1 && !last.active()));
      }
    }
  }

  int stream_index(stream_ref s) const {
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i] == s) return static_cast<int>(i);
    }
    FAIL("unknown stream " << s.value);
    return -1;
  }

  // The bytes a reservation for `rounded` on (pool, stream) would need now. Expandable: the
  // fewest granules any growth maps, at the top of a range (after its free tail) or in a hole
  // between two runs of one range (from either end, with the free blocks beside it). Runs are
  // placed in their range by describe() of an allocation in them; a run with none is not taken as
  // a hole's side, which can only overstate the need (the check that uses it stays sound).
  std::size_t needed_for(const memory_snapshot& snap, std::size_t rounded, stream_ref s) const {
    if (!rc_.expandable) return sc::min_segment_size(rounded);
    const std::size_t g = env_->backend->vmm_granularity();
    struct run {
      const segment_info* seg;
      const void* range;  // nullptr: unknown
    };
    std::vector<run> runs;
    for (const segment_info& seg : snap.segments) {
      if (seg.stream != s || seg.is_large == sc::is_small(rounded)) continue;
      const void* range = nullptr;
      for (const block_info& b : seg.blocks) {
        if (b.allocated()) {
          range = alloc_->describe(reinterpret_cast<void*>(b.address)).segment_base;
          break;
        }
      }
      runs.push_back({&seg, range});
    }
    if (runs.empty()) return sc::round_up(rounded, g);
    const auto free_size = [](const block_info& b) { return b.active() ? std::size_t{0} : b.size; };
    std::size_t need = sc::round_up(rounded - std::min(rounded, free_size(runs.back().seg->blocks.back())), g);
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const bool top = i + 1 == runs.size() || runs[i + 1].range != runs[i].range || runs[i].range == nullptr;
      const std::size_t before = free_size(runs[i].seg->blocks.back());
      if (top) {
        need = std::min(need, sc::round_up(rounded - std::min(rounded, before), g));
        continue;
      }
      const segment_info& a = *runs[i].seg;
      const segment_info& b = *runs[i + 1].seg;
      const std::size_t hole = b.address - (a.address + a.total_size);
      const std::size_t after = free_size(b.blocks.front());
      if (before + hole + after < rounded) continue;
      // Mapped from its low end (after `before`) or its high end (before `after`).
      const std::size_t low = sc::round_up(rounded - std::min(rounded, before), g);
      const std::size_t high = sc::round_up(rounded - std::min(rounded, after), g);
      need = std::min({need, hole, low, high});
    }
    return need;
  }

  void check_oom_is_legitimate(std::size_t n, stream_ref s, const out_of_memory& e) {
    const std::size_t rounded = sc::round_size(n);
    const memory_snapshot snap = alloc_->snapshot();
    const memory_stats st = alloc_->stats();
    INFO("step " << step_ << ": out_of_memory for " << n << " bytes: " << std::string(e.what()));
    CHECK(e.info().requested == n);
    CHECK(e.info().rounded == rounded);
    CHECK(e.info().budget == alloc_->budget());
    CHECK(e.info().allocated == static_cast<std::size_t>(st.allocated_bytes[0].current));
    CHECK(e.info().reserved == static_cast<std::size_t>(st.reserved_bytes[0].current));
    // No cached block of the request's pool and stream could serve it; nor, for a small request
    // with fixed segments, a free block of the large pool that may be split (step 6).
    const std::int64_t max_split = st.max_split_size;
    for (const segment_info& seg : snap.segments) {
      if (seg.stream != s) continue;
      const bool own_pool = seg.is_large != sc::is_small(rounded);
      const bool borrowable = seg.is_large && sc::is_small(rounded) && !rc_.expandable;
      if (!own_pool && !borrowable) continue;
      for (const block_info& b : seg.blocks) {
        const bool splittable = own_pool || max_split < 0 || b.size < static_cast<std::size_t>(max_split);
        CHECK_FALSE((!b.active() && b.size >= rounded && splittable));
      }
    }
    // The frees waiting on other streams were awaited before giving up: every stream's work
    // could run (none is held here).
    for (const segment_info& seg : snap.segments) {
      for (const block_info& b : seg.blocks) {
        CHECK_MESSAGE(b.state != block_state::active_pending_free,
                      "a pending free at " << b.address << " was not awaited before out_of_memory");
      }
    }
    // And no new memory fits: not within the budget, or not on the device.
    const std::size_t need = needed_for(snap, rounded, s);
    const std::size_t reserved = static_cast<std::size_t>(st.reserved_bytes[0].current);
    const bool over_budget = alloc_->budget() != unlimited_budget && reserved + need > alloc_->budget();
    const bool device_full = env_->backend->free_memory() < need;
    CHECK_MESSAGE((over_budget || device_full),
                  "needs " << need << ", reserved " << reserved << ", budget " << alloc_->budget()
                           << ", device free " << env_->backend->free_memory());
  }

  // (base, live blocks, allocated bytes) of the fixed segments with live and free blocks and no
  // pending ones, by address: from the snapshot, and as partly_free_segments lists them.
  using usage_key = std::tuple<std::uintptr_t, std::size_t, std::size_t>;
  std::vector<usage_key> partly_free_in(const memory_snapshot& snap) const {
    std::vector<usage_key> out;
    for (const segment_info& seg : snap.segments) {
      if (seg.is_expandable) continue;
      std::size_t live = 0, bytes = 0;
      bool any_free = false, pending = false;
      for (const block_info& b : seg.blocks) {
        if (b.allocated()) {
          ++live;
          bytes += b.size;
        }
        any_free |= b.state == block_state::inactive;
        pending |= b.state == block_state::active_pending_free;
      }
      if (live > 0 && any_free && !pending) out.emplace_back(seg.address, live, bytes);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  std::vector<usage_key> partly_free_listed() const {
    std::vector<usage_key> out;
    for (const segment_usage& u : alloc_->partly_free_segments()) {
      out.emplace_back(reinterpret_cast<std::uintptr_t>(u.base), u.live_blocks, u.allocated_bytes);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  void check_step(std::int64_t reserved_before) {
    const memory_snapshot snap = alloc_->snapshot();
    const memory_stats st = alloc_->stats();
    INFO("step " << step_ << " (seed " << rc_.seed << ")");
    check_snapshot_invariants(snap);
    check_stats_match_snapshot(st, snap);
    // The allocator's running count of releasable bytes (block_pool.hpp) equals the snapshot's.
    CHECK(alloc_->releasable_bytes() == releasable_in(snap));
    // So do the per-segment counts behind partly_free_segments (Note [Compaction]).
    CHECK(partly_free_in(snap) == partly_free_listed());

    // Allocated blocks are exactly the model's live allocations; pending ones are model frees.
    std::size_t allocated_seen = 0;
    for (const segment_info& seg : snap.segments) {
      for (const block_info& b : seg.blocks) {
        if (b.allocated()) {
          ++allocated_seen;
          auto it = live_.find(b.address);
          if (it == live_.end()) {
            FAIL_CHECK("allocated block at " << b.address << " is not a live allocation");
            continue;
          }
          const live_allocation& a = it->second;
          INFO("allocation " << a.id << " at " << b.address);
          CHECK(b.requested_size == a.requested);
          CHECK(b.size >= a.rounded);
          CHECK((b.size == a.rounded || !sc::should_split(b.size, a.rounded)));
          // Large requests only in large segments; a small one in a large segment only when it
          // took a large block under pressure (step 6), never with expandable segments.
          CHECK((seg.is_large || sc::is_small(a.rounded)));
          if (seg.is_large && sc::is_small(a.rounded)) CHECK_FALSE(rc_.expandable);
          CHECK(seg.stream == a.stream);
          CHECK(seg.is_expandable == rc_.expandable);
        } else if (b.state == block_state::active_pending_free) {
          auto it = pending_.find(b.address);
          if (it == pending_.end()) {
            FAIL_CHECK("pending block at " << b.address << " was never freed with record_stream");
          } else {
            CHECK(b.size == it->second.size);
          }
        }
      }
    }
    CHECK(allocated_seen == live_.size());

    // Pending frees that left the pending state: their streams' earlier kernels have completed.
    for (auto it = pending_.begin(); it != pending_.end();) {
      const block_info* b = find_block(snap, reinterpret_cast<void*>(it->first));
      if (b != nullptr && b->state == block_state::active_pending_free) {
        ++it;
        continue;
      }
      for (auto [si, fence] : it->second.fences) {
        CHECK_MESSAGE((*completed_)[static_cast<std::size_t>(si)] >= fence,
                      "block " << it->first << " became free before stream " << si
                               << " finished the work queued before its free");
      }
      requested_freed_ += it->second.requested;
      it = pending_.erase(it);
    }

    // Statistics against the model's own counts.
    std::size_t requested_now = 0;
    for (const auto& [address, a] : live_) requested_now += a.requested;
    for (const auto& [address, pb] : pending_) requested_now += pb.requested;
    CHECK(st.allocation[0].current == static_cast<std::int64_t>(live_.size()));
    CHECK(st.allocation[0].allocated == static_cast<std::int64_t>(allocs_));
    CHECK(st.allocation[0].freed == static_cast<std::int64_t>(frees_));
    CHECK(st.requested_bytes[0].current == static_cast<std::int64_t>(requested_now));
    CHECK(st.requested_bytes[0].allocated == static_cast<std::int64_t>(requested_total_));
    CHECK(st.requested_bytes[0].freed == static_cast<std::int64_t>(requested_freed_));
    CHECK(st.num_ooms == static_cast<std::int64_t>(ooms_));
    CHECK(st.num_invalid_frees == 0);
    for (const named_stat_array& arr : all_stat_arrays) {
      for (int i = 0; i < stat_type_count; ++i) {
        INFO(std::string(arr.name) << " " << stat_type_name(i));
        CHECK((st.*arr.member)[i].peak >= (previous_.*arr.member)[i].peak);  // peaks only grow
      }
    }
    // Reservations stay within the budget.
    const std::int64_t reserved = st.reserved_bytes[0].current;
    if (reserved > reserved_before && alloc_->budget() != unlimited_budget) {
      CHECK(reserved <= static_cast<std::int64_t>(alloc_->budget()));
    }
    previous_ = st;
  }

  void check_all_patterns() {
    for (const auto& [address, a] : live_) {
      std::size_t bad = 0;
      CHECK_MESSAGE(pattern_ok(reinterpret_cast<void*>(address), a.requested, a.id, &bad),
                    "step " << step_ << ": allocation " << a.id << " overwritten at offset " << bad);
    }
  }

  run_config rc_;
  std::mt19937_64 rng_;
  std::unique_ptr<backend_env> env_;
  std::vector<stream_ref> streams_;
  std::unique_ptr<device_allocator> alloc_;
  std::shared_ptr<std::vector<std::uint64_t>> completed_;  // kernels completed per stream
  std::vector<std::uint64_t> launched_;                    // kernels queued per stream
  std::map<std::uintptr_t, live_allocation> live_;
  std::map<std::uintptr_t, pending_block> pending_;
  memory_stats previous_;
  int step_ = 0;
  std::uint64_t next_id_ = 0;
  std::uint64_t allocs_ = 0, frees_ = 0, ooms_ = 0, deferred_ = 0, budget_refusals_ = 0;
  std::uint64_t requested_total_ = 0, requested_freed_ = 0;
};

}  // namespace

TEST_CASE("model: fixed segments under changing budgets") {
  std::uint64_t ooms = 0, deferred = 0;
  for (std::uint64_t seed : {1, 2, 3}) {
    run_config rc;
    rc.seed = seed;
    model_run run(rc);
    run.run();
    ooms += run.ooms();
    deferred += run.deferred();
  }
  // The runs exercised what they are meant to: budget pressure and cross-stream frees.
  CHECK(ooms > 0);
  CHECK(deferred > 0);
}

TEST_CASE("model: expandable segments under changing budgets") {
  std::uint64_t ooms = 0, deferred = 0;
  for (std::uint64_t seed : {11, 12, 13}) {
    run_config rc;
    rc.seed = seed;
    rc.expandable = true;
    model_run run(rc);
    run.run();
    ooms += run.ooms();
    deferred += run.deferred();
  }
  CHECK(ooms > 0);
  CHECK(deferred > 0);
}

TEST_CASE("model: a small device runs out of memory, no budget") {
  std::uint64_t ooms = 0;
  for (bool expandable : {false, true}) {
    run_config rc;
    rc.seed = expandable ? 21 : 22;
    rc.expandable = expandable;
    rc.budgets = false;
    rc.capacity = 160 * MiB;
    model_run run(rc);
    run.run();
    ooms += run.ooms();
  }
  CHECK(ooms > 0);
}
