// test_engine_compaction: Note [Compaction]. Under a budget with fixed segments, the engine first
// empties the segments cheapest to empty by moving their buffers into other segments' holes, and
// evicts only what that cannot cover.
//
// The layout every case starts from: a 40 MiB budget, two 20 MiB segments A and B, each filled
// with five 4 MiB sources (no lineage: spill only). The test forgets some of them to punch holes:
// A keeps A2 (offset 8), B keeps B1 and B3 (offsets 4 and 12). A 12 MiB request fits in no hole,
// and a third segment would pass the budget by 20 MiB, though 28 MiB of the 40 are free.
//
// It proves: the request is served by moving A2 into a hole of B, nothing evicted, A counted as
// emptied (buffers registered a little smaller than their blocks);
// the moved buffer is intact, behind work still queued on its stream when it moved; a buffer
// another stream used is moved only as a last resort (its old block's free waits for that
// stream: a segment without one is emptied first), and then behind that stream; with compaction
// off the same request evicts; pinned
// buffers and allocations the engine does not own are never moved (the other segment is emptied
// instead); a segment whose buffers do not all find a hole elsewhere is not touched (all or none)
// and eviction serves the request; a buffer moved into the other pool is known to be there; the
// allocator's snapshot tiles and matches its statistics.
#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "engine_fixture.hpp"

using namespace spillway;
using namespace spillway::test;

namespace {

// Each source fills a 4 MiB block (its size rounds up to 4 MiB, 512-byte granules), registered
// 8 bytes short of it: the registered size is not the block's.
constexpr std::size_t k_buffer = 4 * MiB - 8;

struct two_segments;

struct layout_options {
  bool compact = true;
  int streams = 0;           // besides the default stream
  bool allow_spill = true;   // the sources have no lineage: false leaves nothing to evict
  std::function<void(two_segments&)> between;  // after A's holes are punched, before B's
};

struct two_segments {
  engine_env env;
  lineage_graph g{env};
  std::vector<buffer_id> a, b;  // the five sources of each segment, in address order

  explicit two_segments(const layout_options& o = {}) : env(options(o)) {
    for (int i = 0; i < 5; ++i) a.push_back(g.source(k_buffer));
    for (int i = 0; i < 5; ++i) b.push_back(g.source(k_buffer));
    REQUIRE(env.alloc->stats().reserved_bytes[0].current == static_cast<std::int64_t>(40 * MiB));
    REQUIRE(env.alloc->stats().segment[0].current == 2);
    for (int i : {0, 1, 3, 4}) env.eng().forget(a[static_cast<std::size_t>(i)]);
    if (o.between) o.between(*this);
    for (int i : {0, 2, 4}) env.eng().forget(b[static_cast<std::size_t>(i)]);
    // The fills are still queued on the stream: a move must copy behind them.
  }
  static engine_options options(const layout_options& l) {
    engine_options o;
    o.budget = 40 * MiB;
    o.streams = l.streams;
    o.engine.policy = "lru";
    o.engine.compact = l.compact;
    o.engine.allow_spill = l.allow_spill;
    return o;
  }
  buffer_id a2() const { return a[2]; }
  // A2 used on the other stream (env.stream(0)): its own stream zeroes it, then a long kernel
  // there, ordered behind that, writes its bytes back. Returns that stream.
  stream_ref use_a2_on_other_stream() {
    const stream_ref other = env.stream(0);
    const auto golden = g.at(a2()).golden;
    pinned_buffer own = env.eng().pin(a2());
    pinned_buffer use = env.eng().pin(a2(), other);
    void* at = use.get();
    env.sim->launch({}, 100, [at] { std::memset(at, 0, k_buffer); });
    env.sim->launch(other, 1'000'000, [at, golden] { std::memcpy(at, golden->data(), k_buffer); });
    return other;
  }
  std::vector<buffer_id> kept() const { return {a[2], b[1], b[3]}; }
  void* where(buffer_id id) { return env.eng().pin(id).get(); }
  void check_allocator() const {
    const memory_snapshot snap = env.alloc->snapshot();
    check_snapshot_invariants(snap);
    check_stats_match_snapshot(env.alloc->stats(), snap);
  }
  void expect_kept() {
    for (buffer_id id : kept()) g.expect(id);
    env.sim->run_until_idle();
    env.check_clean();
  }
};

}  // namespace

TEST_CASE("compaction: a request over budget is served by moving a buffer, nothing evicted") {
  two_segments t;
  void* const a2_before = t.where(t.a2());
  const void* const b1 = t.where(t.b[1]);
  const void* const b3 = t.where(t.b[3]);

  void* p = t.env.alloc->allocate(12 * MiB);
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.evictions == 0);
  CHECK(s.moves == 1);
  CHECK(s.bytes_moved == k_buffer);
  CHECK(s.segments_emptied == 1);
  CHECK(t.env.alloc->stats().reserved_bytes[0].current == static_cast<std::int64_t>(40 * MiB));
  for (buffer_id id : t.kept()) CHECK(t.env.eng().state(id) == buffer_state::resident);
  // A2 moved into B; B's buffers stayed where they were.
  void* const a2_after = t.where(t.a2());
  CHECK(a2_after != a2_before);
  CHECK(t.env.alloc->describe(a2_after).segment_base == t.env.alloc->describe(b1).segment_base);
  CHECK(t.where(t.b[1]) == b1);
  CHECK(t.where(t.b[3]) == b3);
  t.env.sim->launch({}, 100, [p] { std::memset(p, 0x5A, 12 * MiB); });
  t.check_allocator();
  t.expect_kept();  // A2 was copied after its fill kernel ran, not before
  t.env.alloc->deallocate(p);
  t.check_allocator();
}

TEST_CASE("compaction off: the same request evicts") {
  two_segments t({.compact = false});
  void* p = t.env.alloc->allocate(12 * MiB);
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.evictions > 0);
  CHECK(s.moves == 0);
  CHECK(s.segments_emptied == 0);
  t.env.alloc->deallocate(p);
  t.expect_kept();
}

TEST_CASE("compaction never moves a pinned buffer: the other segment is emptied instead") {
  two_segments t;
  pinned_buffer hold = t.env.eng().pin(t.a2());
  const void* const at = hold.get();
  const void* const b1 = t.where(t.b[1]);

  void* p = t.env.alloc->allocate(12 * MiB);
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.evictions == 0);
  CHECK(s.moves == 2);  // B1 and B3, into A's two 8 MiB holes
  CHECK(s.segments_emptied == 1);
  CHECK(t.env.eng().pin(t.a2()).get() == at);
  CHECK(t.env.alloc->describe(t.where(t.b[1])).segment_base == t.env.alloc->describe(at).segment_base);
  CHECK(t.where(t.b[1]) != b1);
  hold.reset();
  t.env.alloc->deallocate(p);
  t.expect_kept();
  t.check_allocator();
}

TEST_CASE("compaction never moves an allocation the engine does not own") {
  two_segments t;
  // A foreign 8 MiB block in A's first hole: A cannot be emptied; B can, into A's last hole.
  void* foreign = t.env.alloc->allocate(8 * MiB);
  const void* const a2 = t.where(t.a2());
  REQUIRE(t.env.alloc->describe(foreign).segment_base == t.env.alloc->describe(a2).segment_base);
  void* p = t.env.alloc->allocate(12 * MiB);
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.evictions == 0);
  CHECK(s.moves == 2);
  CHECK(s.segments_emptied == 1);
  CHECK(t.where(t.a2()) == a2);
  CHECK(t.env.alloc->owns(foreign));
  t.env.alloc->deallocate(p);
  t.env.alloc->deallocate(foreign);
  t.expect_kept();
  t.check_allocator();
}

TEST_CASE("compaction moves all of a segment's buffers or none") {
  // Foreign blocks fill A but for one 4 MiB hole (taken before B's holes are punched, so that
  // they land in A): B1 would fit there, B3 nowhere outside B. Neither moves: the hole taken for
  // B1 is given back. With spills off there is nothing to evict: out of memory, nothing changed.
  std::vector<void*> foreign;
  two_segments t({.allow_spill = false, .between = [&](two_segments& s) {
                    foreign.push_back(s.env.alloc->allocate(8 * MiB));  // A at 0
                    foreign.push_back(s.env.alloc->allocate(4 * MiB));  // A at 12: 16-20 free
                  }});
  const void* const b1 = t.where(t.b[1]);
  const void* const b3 = t.where(t.b[3]);
  const std::uintptr_t a_base = t.env.alloc->snapshot().segments.front().address;
  CHECK_THROWS_AS((void)t.env.alloc->allocate(12 * MiB), out_of_memory);
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.moves == 0);
  CHECK(s.segments_emptied == 0);
  CHECK(s.evictions == 0);
  CHECK(t.where(t.b[1]) == b1);
  CHECK(t.where(t.b[3]) == b3);
  // A's last 4 MiB, taken for B1 while its move was planned, are free again.
  bool found = false;
  for (const segment_info& seg : t.env.alloc->snapshot().segments) {
    for (const block_info& blk : seg.blocks) {
      if (blk.address != a_base + 16 * MiB) continue;
      found = true;
      CHECK(blk.state == block_state::inactive);
    }
  }
  CHECK(found);
  t.check_allocator();
  for (void* f : foreign) t.env.alloc->deallocate(f);
  t.expect_kept();
  t.check_allocator();
}

TEST_CASE("compaction empties a segment no other stream used first: B, not A") {
  // A2's old block could not be given back before the other stream's work is done (its free
  // waits for it): A would not be empty when the round ends. B's two buffers move instead.
  two_segments t({.streams = 1});
  const stream_ref other = t.use_a2_on_other_stream();
  void* const a2_block = t.where(t.a2());
  void* p = t.env.alloc->allocate(12 * MiB);
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.moves == 2);
  CHECK(s.segments_emptied == 1);
  CHECK(s.evictions == 0);
  CHECK(t.where(t.a2()) == a2_block);
  CHECK(t.env.alloc->describe(t.where(t.b[1])).segment_base == t.env.alloc->describe(a2_block).segment_base);
  t.env.sim->launch({}, 100, [p] { std::memset(p, 0xA5, 12 * MiB); });
  t.env.alloc->deallocate(p);
  // The other stream's write is the program's to wait for before it reads A2 on its own stream.
  t.env.sim->synchronize_stream(other);
  t.expect_kept();
  CHECK(t.env.log.checks() == 3);
  t.check_allocator();
}

TEST_CASE("compaction: as a last resort a buffer another stream used moves, after that stream") {
  // B cannot be emptied (B1 pinned): A is, though A2 was used on another stream. The copy waits
  // for that stream: a long kernel there writes A2's bytes back after its own stream zeroed them,
  // and a copy that did not wait for it would move the zeros.
  two_segments t({.streams = 1});
  (void)t.use_a2_on_other_stream();
  pinned_buffer hold = t.env.eng().pin(t.b[1]);
  void* const old_block = t.where(t.a2());
  void* p = t.env.alloc->allocate(12 * MiB);
  CHECK(t.env.eng().stats().moves == 1);
  CHECK(t.env.eng().stats().segments_emptied == 1);
  CHECK(t.env.eng().stats().evictions == 0);
  CHECK(t.where(t.a2()) != old_block);
  t.env.sim->launch({}, 100, [p] { std::memset(p, 0xA5, 12 * MiB); });
  t.env.alloc->deallocate(p);
  hold.reset();
  t.expect_kept();
  CHECK(t.env.log.checks() == 3);
  t.check_allocator();
}

TEST_CASE("compaction: a move keeps the buffer's place in the LRU order") {
  // After A2 moves into B (B: A2, B1, hole, B3, hole), a second 12 MiB request must evict (B's
  // three buffers find holes for two only): LRU takes the oldest first, A2 (registered before
  // B's), then B1 (B3 may then move into A, emptying B). Had the move counted as a use, B1 and
  // B3 would have been evicted and A2 kept.
  two_segments t;
  void* p = t.env.alloc->allocate(12 * MiB);
  REQUIRE(t.env.eng().stats().moves == 1);
  REQUIRE(t.env.eng().stats().evictions == 0);
  void* q = t.env.alloc->allocate(12 * MiB);
  CHECK(t.env.eng().state(t.a2()) != buffer_state::resident);
  CHECK(t.env.eng().state(t.b[1]) != buffer_state::resident);
  CHECK(t.env.eng().state(t.b[3]) == buffer_state::resident);
  t.env.alloc->deallocate(q);
  t.env.alloc->deallocate(p);
  t.expect_kept();
  t.check_allocator();
}

TEST_CASE("compaction never moves a buffer into a segment it has just emptied") {
  // Three segments under 60 MiB: A keeps A2; B keeps B1 and B3; C keeps four. A 30 MiB request
  // is 30 MiB over the budget: emptying A (into a hole of B) is not enough, and B's buffers must
  // not go into A's free space: A would not be empty any more. With no other hole for them,
  // eviction serves the rest.
  engine_options o;
  o.budget = 60 * MiB;
  o.engine.policy = "lru";
  engine_env env(o);
  lineage_graph g(env);
  std::vector<buffer_id> a, b, c;
  for (auto* seg : {&a, &b, &c}) {
    for (int i = 0; i < 5; ++i) seg->push_back(g.source(k_buffer));
  }
  REQUIRE(env.alloc->stats().segment[0].current == 3);
  for (int i : {0, 1, 3, 4}) env.eng().forget(a[static_cast<std::size_t>(i)]);
  for (int i : {0, 2, 4}) env.eng().forget(b[static_cast<std::size_t>(i)]);
  env.eng().forget(c[4]);
  const auto base_of = [&](buffer_id id) { return env.alloc->describe(env.eng().pin(id).get()).segment_base; };
  void* const seg_a = base_of(a[2]);

  void* p = env.alloc->allocate(30 * MiB);
  const eviction::engine_stats s = env.eng().stats();
  CHECK(s.moves >= 1);
  CHECK(s.segments_emptied == 1);  // A only
  for (buffer_id id : {a[2], b[1], b[3], c[0], c[1], c[2], c[3]}) {
    if (env.eng().state(id) == buffer_state::resident) CHECK(base_of(id) != seg_a);
  }
  env.alloc->deallocate(p);
  for (buffer_id id : {a[2], b[1], b[3], c[0], c[1], c[2], c[3]}) g.expect(id);
  env.sim->run_until_idle();
  env.check_clean();
  const memory_snapshot snap = env.alloc->snapshot();
  check_snapshot_invariants(snap);
  check_stats_match_snapshot(env.alloc->stats(), snap);
}

TEST_CASE("compaction: a copy that cannot be queued stops it; the buffer stays, eviction serves") {
  two_segments t;
  const void* const a2 = t.where(t.a2());
  t.env.sim->fail_nth(fault_site::copy, 1);  // the move's device-to-device copy
  void* p = t.env.alloc->allocate(12 * MiB);
  t.env.sim->clear_faults();
  const eviction::engine_stats s = t.env.eng().stats();
  CHECK(s.moves == 0);
  CHECK(s.segments_emptied == 0);
  CHECK(s.evictions > 0);
  if (t.env.eng().state(t.a2()) == buffer_state::resident) CHECK(t.where(t.a2()) == a2);
  t.check_allocator();
  t.env.alloc->deallocate(p);
  t.expect_kept();
  t.check_allocator();
}

TEST_CASE("compaction: a buffer moved into the other pool is known to be there") {
  // x is registered at 512 KiB on a 2 MiB block (the large pool's 20 MiB segment). A 19 MiB
  // request fits only once that segment is given back: x moves into the small pool's free MiB.
  // Its pool is what the pressure path and dtr-frag match against a request: it follows the move.
  engine_options o;
  o.budget = 24 * MiB;
  o.engine.policy = "lru";
  engine_env env(o);
  void* xp = env.alloc->allocate(2 * MiB);
  const buffer_id x = env.eng().register_buffer(xp, MiB / 2, stream_ref{});
  void* f1 = env.alloc->allocate(MiB / 2);  // the small pool's 2 MiB segment, 1 MiB left free
  void* f2 = env.alloc->allocate(MiB / 2);
  REQUIRE_FALSE(env.eng().describe_candidate(x)->small_pool);
  void* p = env.alloc->allocate(19 * MiB);
  REQUIRE(env.eng().stats().moves == 1);
  CHECK(env.alloc->describe(env.eng().pin(x).get()).segment_size == 2 * MiB);
  CHECK(env.eng().describe_candidate(x)->small_pool);
  for (void* q : {p, f1, f2}) env.alloc->deallocate(q);
  env.eng().forget(x);
  env.sim->run_until_idle();
}
