// policy: which resident buffer to evict next. Pluggable.
//
// The engine offers its eviction candidates (resident, unpinned, evictable buffers) through a
// candidate_view that is valid for one choose() call, and evicts what the policy returns. It calls
// choose() again until the request is met, so a policy picks one victim at a time.
//
// Policies provided (make_policy(name)):
//   "dtr"            DTR's h = cost / (size x staleness), staleness giving way to the predicted
//                    time to the next use where the engine has one (Note [Next-use prediction]),
//                    with cost the buffer's own plus that of
//                    the classes of dropped buffers next to it in the lineage graph (DTR's evicted
//                    neighbourhood); evaluated on a random sample of ceil(sqrt(n)) candidates
//                    joined by the 8 cheapest per byte (all of them when n <= 64), described
//                    in one describe() call, so a decision is O(sqrt n)
//   "lru"            the least recently used candidate, O(1)
//   "largest"        the largest candidate, O(log n)
//   "dtr-frag"       fragmentation-aware DTR: among sampled candidates, those whose eviction
//                    serves the pending request win, by DTR's h: a contiguous range that fits it
//                    in its pool and stream, or a whole segment covering the budget shortfall
//                    (given back, it makes room for a new segment); if none does, the one leaving
//                    the largest range (in 1/16ths of the request, h breaking ties) wins, so
//                    evictions grow one hole; with nothing sampled in the request's pool and
//                    stream, the whole segment with the smallest h, else plain DTR; with
//                    expandable segments DTR's best elsewhere competes too, by the whole
//                    granules its eviction frees (policy_dtr.cpp explains why)
// A policy object serves one engine: choose() is not thread-safe (the sampling policies advance
// their random generator) and is called under the engine's lock.
// See Note [Eviction policies] in docs/eviction.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/device_backend.hpp"
#include "spillway/eviction/buffer.hpp"

namespace spillway::eviction {

// What a policy may know about one candidate.
struct candidate_info {
  buffer_id id;
  std::size_t size = 0;
  stream_ref stream;               // the stream of the pool its block is in (where it frees a range)
  bool small_pool = false;
  double staleness_ns = 0;         // time since its last pin or registration (>= 1)
  // Predicted time until it is next needed (eviction_engine::begin_step): its next pin, or, if
  // sooner, the next pin of a dropped buffer that would be rematerialised from it. NaN without a
  // prediction. DTR's score prefers it to staleness.
  double next_use_ns = std::numeric_limits<double>::quiet_NaN();
  double cost_ns = 0;              // the cheaper of recomputing (own node) and spilling it back
  double neighbourhood_cost_ns = 0;  // the classes of dropped buffers next to it in the lineage graph
  std::size_t segment_size = 0;      // the allocator segment that holds its block
  bool whole_segment = false;        // its block is that whole segment: evicting it frees the segment
};

// The pending request: the contiguous size the allocator needs, on which stream and pool.
struct eviction_request {
  stream_ref stream;
  std::size_t bytes = 0;       // contiguous bytes wanted (0: just free `shortfall` bytes)
  bool small_pool = false;
  // Bytes over the budget that a new segment for the request would need (0: one fits): freeing
  // whole segments of that many bytes lets the allocator give them back and reserve one.
  std::size_t shortfall = 0;
  // False (expandable segments): besides a free range in place, whole free granules anywhere
  // that cover `shortfall` serve the request (they are unmapped and mapped where it goes); bytes
  // freed among live blocks of their granules do not. See pressure_request::contiguous.
  bool contiguous = true;
};

class candidate_view {
 public:
  virtual ~candidate_view() = default;
  virtual std::size_t count() const = 0;
  virtual candidate_info at(std::size_t index) const = 0;   // any order; O(1)
  // out[k] = at(indices[k]) for k < min(sizes): a whole sample in one call. The engine's view
  // overrides it; this default calls at().
  virtual void describe(std::span<const std::size_t> indices, std::span<candidate_info> out) const;
  virtual std::optional<candidate_info> least_recently_used() const = 0;
  virtual std::optional<candidate_info> largest() const = 0;
  // Up to out.size() candidates that cost the least per byte to drop (recompute cost with the
  // neighbourhood's, over the size), cheapest first, as indices for at() and describe(); returns
  // how many. None that cannot be dropped: a spill costs about the same per byte for every buffer.
  // DTR's h is a cost per byte over the horizon, so a random sample finds the distant horizons and
  // this the cheap bytes. The engine keeps the order (an intrusive tree with its first 16 cached:
  // an array read); this default has none and returns 0.
  virtual std::size_t cheapest_per_byte(std::span<std::size_t> out) const;
  // The contiguous free range that evicting `id` would leave, counting free and pending-free
  // neighbours (device_allocator::coalesced_size_if_freed). Costs a lookup in the allocator.
  virtual std::size_t contiguous_if_evicted(buffer_id id) const = 0;
  // The bytes that evicting `id` would let the allocator give back to the device: its segment
  // if that empties it, or, with expandable segments, the whole granules it frees
  // (device_allocator::releasable_if_freed). Costs a lookup in the allocator.
  virtual std::size_t releasable_if_evicted(buffer_id id) const = 0;
};

class eviction_policy {
 public:
  virtual ~eviction_policy() = default;
  virtual std::string_view name() const noexcept = 0;
  // The next victim, or nullopt when the policy will pick none of the candidates.
  virtual std::optional<buffer_id> choose(const candidate_view& candidates,
                                          const eviction_request& request) = 0;
};

// DTR's score; smaller is a better victim.
double dtr_score(const candidate_info& c) noexcept;

// "dtr", "lru", "largest", "dtr-frag". Throws spillway::invalid_argument naming the name and the
// choices for anything else. `seed` drives the sampling.
std::unique_ptr<eviction_policy> make_policy(std::string_view name, std::uint64_t seed = 1);
std::vector<std::string> policy_names();

}  // namespace spillway::eviction
