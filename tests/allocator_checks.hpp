// allocator_checks: assertions shared by the allocator tests.
//
// - check_snapshot_invariants: Note [Block tiling] as seen through snapshot(): blocks tile each
//   segment exactly, in address order, 512-byte aligned; no two free blocks are neighbours; the
//   segment totals are the sums of their blocks; segments do not overlap.
// - check_stats_match_snapshot: every "current" statistic that a snapshot determines (segments,
//   reserved, allocations, allocated, requested, active, inactive_split) equals what the snapshot
//   shows, for the aggregate and for each pool; and each stat is internally consistent.
// - check_same_state: two stats/snapshot pairs are identical, field by field (for "nothing changed").
// - fill_pattern / pattern_ok: an id-derived pattern written through a (host-visible) device pointer;
//   one 8-byte word every 512 bytes plus the last bytes, which is enough to expose any overlap of
//   two 512-aligned blocks.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "spillway/device_allocator.hpp"
#include "spillway/snapshot.hpp"
#include "spillway/stats.hpp"

namespace spillway::test {

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;

inline std::string stat_type_name(int t) {
  return t == 0 ? "aggregate" : t == 1 ? "small_pool" : "large_pool";
}

struct named_stat_array {
  const char* name;
  stat_array memory_stats::*member;
};

inline constexpr named_stat_array all_stat_arrays[] = {
    {"allocation", &memory_stats::allocation},
    {"segment", &memory_stats::segment},
    {"active", &memory_stats::active},
    {"inactive_split", &memory_stats::inactive_split},
    {"allocated_bytes", &memory_stats::allocated_bytes},
    {"reserved_bytes", &memory_stats::reserved_bytes},
    {"active_bytes", &memory_stats::active_bytes},
    {"inactive_split_bytes", &memory_stats::inactive_split_bytes},
    {"requested_bytes", &memory_stats::requested_bytes},
};

inline void check_snapshot_invariants(const memory_snapshot& snap) {
  std::uintptr_t previous_end = 0;
  for (const segment_info& seg : snap.segments) {
    INFO("segment at " << seg.address << " of " << seg.total_size << " bytes");
    CHECK(seg.address % 512 == 0);
    CHECK(seg.address >= previous_end);  // listed in address order, no overlap
    previous_end = seg.address + seg.total_size;
    REQUIRE(!seg.blocks.empty());
    CHECK(seg.blocks.front().address == seg.address);
    std::uintptr_t expected_address = seg.address;
    std::size_t allocated = 0, requested = 0, active = 0;
    bool previous_free = false;
    for (const block_info& b : seg.blocks) {
      INFO("block at " << b.address << " of " << b.size << " bytes");
      CHECK(b.address == expected_address);  // no gap, no overlap
      CHECK(b.size > 0);
      CHECK(b.size % 512 == 0);
      expected_address = b.address + b.size;
      if (b.allocated()) allocated += b.size;
      if (b.active()) {  // requested sizes count while a block is active, as in PyTorch
        active += b.size;
        requested += b.requested_size;
        CHECK(b.requested_size > 0);
        CHECK(b.requested_size <= b.size);
      }
      if (!b.active()) CHECK(b.requested_size == 0);
      CHECK_FALSE((previous_free && !b.active()));  // free neighbours are always coalesced
      previous_free = !b.active();
    }
    CHECK(expected_address == seg.address + seg.total_size);  // the blocks cover the segment
    CHECK(seg.allocated_size == allocated);
    CHECK(seg.requested_size == requested);
    CHECK(seg.active_size == active);
  }
}

// The per-pool "current" values a snapshot determines.
struct snapshot_totals {
  std::int64_t segment[3] = {};
  std::int64_t reserved[3] = {};
  std::int64_t allocation[3] = {};
  std::int64_t allocated[3] = {};
  std::int64_t requested[3] = {};
  std::int64_t active[3] = {};
  std::int64_t active_bytes[3] = {};
  std::int64_t inactive_split[3] = {};
  std::int64_t inactive_split_bytes[3] = {};
};

inline snapshot_totals totals_of(const memory_snapshot& snap) {
  snapshot_totals t;
  for (const segment_info& seg : snap.segments) {
    for (int i : {0, seg.is_large ? 2 : 1}) {
      t.segment[i] += 1;
      t.reserved[i] += static_cast<std::int64_t>(seg.total_size);
      for (const block_info& b : seg.blocks) {
        const auto size = static_cast<std::int64_t>(b.size);
        if (b.allocated()) {
          t.allocation[i] += 1;
          t.allocated[i] += size;
        }
        if (b.active()) {
          t.active[i] += 1;
          t.active_bytes[i] += size;
          t.requested[i] += static_cast<std::int64_t>(b.requested_size);
        } else if (seg.blocks.size() > 1 && !seg.is_expandable) {  // a free piece of a split segment
          t.inactive_split[i] += 1;
          t.inactive_split_bytes[i] += size;
        }
      }
    }
  }
  return t;
}

// accumulated_intact: reset_accumulated_stats() was not called, so allocated - freed == current.
inline void check_stats_match_snapshot(const memory_stats& st, const memory_snapshot& snap,
                                       bool accumulated_intact = true) {
  const snapshot_totals t = totals_of(snap);
  for (int i = 0; i < stat_type_count; ++i) {
    INFO("pool " << stat_type_name(i));
    CHECK(st.segment[i].current == t.segment[i]);
    CHECK(st.reserved_bytes[i].current == t.reserved[i]);
    CHECK(st.allocation[i].current == t.allocation[i]);
    CHECK(st.allocated_bytes[i].current == t.allocated[i]);
    CHECK(st.requested_bytes[i].current == t.requested[i]);
    CHECK(st.active[i].current == t.active[i]);
    CHECK(st.active_bytes[i].current == t.active_bytes[i]);
    CHECK(st.inactive_split[i].current == t.inactive_split[i]);
    CHECK(st.inactive_split_bytes[i].current == t.inactive_split_bytes[i]);
    for (const named_stat_array& a : all_stat_arrays) {
      const stat& s = (st.*a.member)[static_cast<std::size_t>(i)];
      INFO(std::string(a.name) << ": current " << s.current << " peak " << s.peak << " allocated "
                  << s.allocated << " freed " << s.freed);
      CHECK(s.current >= 0);
      CHECK(s.peak >= s.current);
      if (accumulated_intact) CHECK(s.allocated - s.freed == s.current);
    }
  }
  // The aggregate is the sum of the pools.
  for (const named_stat_array& a : all_stat_arrays) {
    const stat_array& s = st.*a.member;
    INFO(std::string(a.name));
    CHECK(s[0].current == s[1].current + s[2].current);
  }
}

inline void check_stat_equal(const char* what, const stat& a, const stat& b) {
  INFO(std::string(what));
  CHECK(a.current == b.current);
  CHECK(a.peak == b.peak);
  CHECK(a.allocated == b.allocated);
  CHECK(a.freed == b.freed);
}

// Every stat array field by field, and the counters that a failed call must not move.
// (num_ooms, num_alloc_retries, num_sync_all_streams, num_invalid_frees are left to the caller:
// a refused call counts itself there.)
inline void check_same_stats(const memory_stats& before, const memory_stats& after) {
  for (const named_stat_array& a : all_stat_arrays) {
    for (int i = 0; i < stat_type_count; ++i) {
      INFO("pool " << stat_type_name(i));
      check_stat_equal(a.name, (before.*a.member)[static_cast<std::size_t>(i)],
                       (after.*a.member)[static_cast<std::size_t>(i)]);
    }
  }
  CHECK(before.num_device_alloc == after.num_device_alloc);
  CHECK(before.num_device_free == after.num_device_free);
  CHECK(before.budget == after.budget);
  CHECK(before.num_pressure_handler_calls == after.num_pressure_handler_calls);
  CHECK(before.pressure_handler_freed_bytes == after.pressure_handler_freed_bytes);
  CHECK(before.num_releases_before_eviction == after.num_releases_before_eviction);
}

inline void check_same_snapshot(const memory_snapshot& a, const memory_snapshot& b) {
  REQUIRE(a.segments.size() == b.segments.size());
  for (std::size_t i = 0; i < a.segments.size(); ++i) {
    const segment_info& x = a.segments[i];
    const segment_info& y = b.segments[i];
    INFO("segment " << i);
    CHECK(x.device == y.device);
    CHECK(x.address == y.address);
    CHECK(x.total_size == y.total_size);
    CHECK(x.requested_size == y.requested_size);
    CHECK(x.allocated_size == y.allocated_size);
    CHECK(x.active_size == y.active_size);
    CHECK(x.stream == y.stream);
    CHECK(x.is_large == y.is_large);
    CHECK(x.is_expandable == y.is_expandable);
    REQUIRE(x.blocks.size() == y.blocks.size());
    for (std::size_t j = 0; j < x.blocks.size(); ++j) {
      INFO("block " << j);
      CHECK(x.blocks[j].address == y.blocks[j].address);
      CHECK(x.blocks[j].size == y.blocks[j].size);
      CHECK(x.blocks[j].requested_size == y.blocks[j].requested_size);
      CHECK(x.blocks[j].state == y.blocks[j].state);
    }
  }
}

// The blocks of a snapshot in one list, in address order.
inline std::vector<block_info> all_blocks(const memory_snapshot& snap) {
  std::vector<block_info> out;
  for (const segment_info& seg : snap.segments) {
    out.insert(out.end(), seg.blocks.begin(), seg.blocks.end());
  }
  return out;
}

inline const block_info* find_block(const memory_snapshot& snap, const void* ptr) {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  for (const segment_info& seg : snap.segments) {
    for (const block_info& b : seg.blocks) {
      if (b.address == a) return &b;
    }
  }
  return nullptr;
}

inline const segment_info* find_segment(const memory_snapshot& snap, const void* ptr) {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  for (const segment_info& seg : snap.segments) {
    if (a >= seg.address && a < seg.address + seg.total_size) return &seg;
  }
  return nullptr;
}

// --- byte patterns through device pointers (host-visible memory only) ---------------------------

inline std::uint64_t pattern_word(std::uint64_t id, std::size_t offset) {
  std::uint64_t x = id * 0x9E3779B97F4A7C15ull + offset;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

// The words at every 512-byte offset that has room for one, then single bytes up to the end
// (at most the last 8 bytes, never overlapping a word).
inline std::size_t pattern_words_end(std::size_t bytes) {
  return bytes < 8 ? 0 : (bytes - 8) / 512 * 512 + 8;
}

inline void fill_pattern(void* ptr, std::size_t bytes, std::uint64_t id) {
  auto* p = static_cast<unsigned char*>(ptr);
  for (std::size_t off = 0; off + 8 <= bytes; off += 512) {
    const std::uint64_t w = pattern_word(id, off);
    std::memcpy(p + off, &w, 8);
  }
  for (std::size_t i = std::max(pattern_words_end(bytes), bytes < 8 ? 0 : bytes - 8); i < bytes; ++i) {
    p[i] = static_cast<unsigned char>(pattern_word(id, i));
  }
}

// True when the pattern of `id` is intact; otherwise `bad_offset` is the first offset that differs.
inline bool pattern_ok(const void* ptr, std::size_t bytes, std::uint64_t id,
                       std::size_t* bad_offset = nullptr) {
  const auto* p = static_cast<const unsigned char*>(ptr);
  auto fail = [&](std::size_t off) {
    if (bad_offset != nullptr) *bad_offset = off;
    return false;
  };
  for (std::size_t off = 0; off + 8 <= bytes; off += 512) {
    std::uint64_t w;
    std::memcpy(&w, p + off, 8);
    if (w != pattern_word(id, off)) return fail(off);
  }
  for (std::size_t i = std::max(pattern_words_end(bytes), bytes < 8 ? 0 : bytes - 8); i < bytes; ++i) {
    if (p[i] != static_cast<unsigned char>(pattern_word(id, i))) return fail(i);
  }
  return true;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The snapshot's invariants hold and the statistics match it.
inline void check_consistent(const device_allocator& a, bool accumulated_intact = true) {
  const memory_snapshot snap = a.snapshot();
  check_snapshot_invariants(snap);
  check_stats_match_snapshot(a.stats(), snap, accumulated_intact);
}

}  // namespace spillway::test
