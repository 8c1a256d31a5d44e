// policy_dtr.cpp: "dtr" and "dtr-frag", DTR's h (dtr_score) over a sample of the candidates.
//
// Sampling (both). With n <= 64 candidates every one is scored. Above that, k = ceil(sqrt(n))
// are: [0, n) is cut into k strata whose lengths differ by at most one, and one index is drawn
// uniformly from each with the policy's generator (SplitMix64). Every candidate is in the sample
// with probability ~k/n, as with DTR's uniform sample, and the sample has no duplicates for the price
// of one draw per stratum. The minimum h of k draws lies, on average, in the best 1/(k+1) of the
// candidates (the best 1% at n = 10,000). The k_cheapest candidates that cost least per byte
// (candidate_view::cheapest_per_byte) join every drawn sample: h is a cost per byte over a
// horizon, and a uniform sample misses the few cheap candidates when most carry a large evicted
// neighbourhood (Note [Eviction policies], "The cheapest per byte join every sample"; thrashing
// runs 97x -> 1.5x on the simulated device). The sample is described in one
// candidate_view::describe call (the engine's reads one record per candidate, with its cost and
// neighbourhood cost cached), then dtr's choose() is one pass over it that keeps the best so far:
// no allocation once the scratch has grown to the sample's size; dtr-frag's adds a second pass over
// the candidates it kept (see Lookups below).
//
// dtr-frag: why it frees a contiguous range quickly. A request that needs `bytes` contiguous on
// one stream and pool is not served by freeing `shortfall` bytes anywhere: DTR's best victims are
// spread over the heap, and evicting them one by one can free far more than the request before
// any hole is large enough, or any segment is empty enough to be given back. There are two ways
// to serve it: a free range in place (in a segment of its stream and pool), or a new segment,
// for which the allocator must first give back whole free segments covering the shortfall (the
// budget caps reserved bytes). dtr-frag ranks the sample in four tiers:
//   1. serves it in one eviction: on the request's stream and pool with
//      contiguous_if_evicted(id) >= bytes (in place), or a block that is its whole segment, of at
//      least the shortfall (any stream or pool: its segment goes back and the new one fits).
//      Among these, the smallest h (DTR) wins.
//   2. grows the largest hole: on the request's stream and pool, none fits. The candidate whose
//      range is the largest fraction of the request wins, in steps of 1/16 of the request, and
//      DTR's h breaks ties within a step (so a few bytes more never buy a much costlier victim).
//      This is what makes the next decision fit: contiguous_if_evicted counts pending-free
//      neighbours, so after this eviction the candidates next to the new hole report the hole
//      plus themselves and win again. Evictions concentrate on one growing hole instead of
//      scattering, and the request is met in about bytes / (typical range) steps.
//   3. nothing on the request's stream and pool was sampled, and a new segment is needed: the
//      whole-segment block with the smallest h; each such eviction gives a segment back.
//      Scattered victims may never empty a segment: a small-pool request that needs a new 2 MiB
//      segment while large segments hold live blocks ran out of rounds that way (ResNet, 0.6).
//   4. otherwise plain DTR over the sample: freed bytes elsewhere still lower the shortfall.
// A fit is not taken at any price, though. When tier 1 always won (until 2026-11-21), on
// the ResNet-1202 trace the fits it took were 10 to 10,000 times DTR's best h (buffers
// needed again at once), 24,000-29,000 drops where dtr made 1,400-8,200. So the fit is weighed
// against the alternative by cost per unit of staleness, h x size (DTR's h is per byte):
//   - against tier 2's candidate when a cheaper one grows a range in place: that way needs about
//     ceil(bytes / its range) evictions like it;
//   - when nothing cheaper is in place and the request is over the budget, against DTR's best of
//     the sample: about ceil(shortfall / its size) evictions like it free the shortfall, their
//     segments given back.
// The fit wins when its rate is at most the alternative's total. With ranges no larger than the
// victims themselves that is about DTR's choice; the fit's advantage is the neighbours it frees
// with it (a range larger than its size) and the rounding up of the alternative's evictions.
// With request.bytes == 0 (set_budget trimming: free `shortfall` bytes of reserved memory) only
// tiers 1 (whole segments), 3 and 4 apply.
// Expandable segments (request.contiguous false) add a third way: whole free granules anywhere
// that cover the shortfall are unmapped and mapped again where the request goes. Bytes freed in
// granules that live blocks share give nothing back, though, and in the small pool's one segment
// small activations lie among parameters and gradients. While dtr-frag chose as dtr there (from
// d9165bf), ResNet-1202 at 22.5% of peak made 180,545 drops (15.955x the baseline's time, on the
// simulated device): rounds of DTR's best victims freed hundreds of MiB of the small pool that no
// release could take, while 2 MiB requests of the large pool waited. So the tiers apply as above,
// and the fit, the range grown in place and DTR's best elsewhere are weighed together by rate, the
// last by the whole granules its eviction frees (releasable_if_evicted, one lookup): if none, it
// is no way at all: 16,248 drops there (2.557x). (The tiers alone, before fits were weighed in
// fc7cc74, had made 15,000-46,000 drops on that trace.)
//
// Lookups: contiguous_if_evicted costs a lookup in the engine and the allocator (~50-80 ns, with
// the allocator's lock), against ~9 ns to sample and score a candidate, so dtr-frag asks it only
// where it can change the answer, and at most k_max_lookups (24) times per decision:
//   - never for a candidate that serves the request without one: its own size is >= bytes (its
//     block is freed whole, so its range is at least its size), or it is a whole segment that
//     covers the shortfall;
//   - only for candidates whose h is below that of the best such fit;
//   - of those, for the 24 with the smallest h. A fit among them is then the best fit of the
//     sample (every candidate left out has a higher h), and tier 2 compares the ranges of the 24
//     cheapest victims. What is lost: a fit ranked below 24 cheaper non-fitting candidates.
// So a decision costs ~1 us of sampling and scoring plus at most 24 lookups (~2 us), whatever the
// heap looks like (bench/policy_bench.cpp measures it; the target is 5 us at 10,000 candidates).
// The survivors of the first pass wait in a scratch vector that belongs to the policy.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "policy_makers.hpp"

namespace spillway::eviction::detail {
namespace {

constexpr std::size_t k_exhaustive_limit = 64;  // score all candidates up to this many
constexpr std::size_t k_frag_steps = 16;        // tier 2 ranks ranges in 1/16ths of the request
constexpr std::size_t k_max_lookups = 24;       // contiguous_if_evicted calls per dtr-frag decision
constexpr std::size_t k_cheapest = 8;           // the cheapest per byte join every drawn sample

std::size_t ceil_sqrt(std::size_t n) noexcept {
  auto r = static_cast<std::size_t>(std::sqrt(static_cast<double>(n)));
  while (r * r < n) ++r;                    // the double may be one below for large n
  while (r > 0 && (r - 1) * (r - 1) >= n) --r;
  return r;
}

// The sampling policies' generator: SplitMix64 (Steele, Lea and Flood), one add and a few
// multiply-xorshifts per draw. std::mt19937_64 regenerates its 312-word state every 312 draws,
// about 1 us that one decision in three paid; sampling needs no more than SplitMix64 gives.
class splitmix64 {
 public:
  using result_type = std::uint64_t;
  explicit splitmix64(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t operator()() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t state_;
};

// A uniform draw in [0, bound): the high half of a 64x64-bit product (Lemire), instead of a
// 64-bit division (tens of cycles, a large share of a decision's cost at 100 draws). The bias,
// at most bound / 2^64, does not matter here.
std::size_t draw_below(splitmix64& rng, std::size_t bound) noexcept {
  __extension__ using u128 = unsigned __int128;  // __extension__: no -Wpedantic warning
  return static_cast<std::size_t>((static_cast<u128>(rng()) * bound) >> 64);
}

std::size_t sample_size(std::size_t n) noexcept {
  return n <= k_exhaustive_limit ? n : ceil_sqrt(n);
}

// A sample of [0, n), as described at the top of the file, described by the view: the strata's
// draws in increasing order, then the cheapest per byte that were not drawn; infos[k] the
// candidate at indices[k]. The vectors keep their capacity from one decision to the next.
struct sample {
  std::vector<std::size_t> indices;
  std::vector<candidate_info> infos;

  sample() {
    indices.reserve(256 + k_cheapest);  // draws of up to 256: n <= 65,536 candidates
    infos.reserve(256 + k_cheapest);
  }

  void draw(const candidate_view& view, splitmix64& rng) {
    const std::size_t n = view.count();
    const std::size_t k = sample_size(n);
    indices.resize(k);
    infos.resize(k);
    if (n <= k_exhaustive_limit) {
      for (std::size_t i = 0; i < n; ++i) indices[i] = i;
    } else {
      const std::size_t base = n / k;  // the first n % k strata are one longer
      const std::size_t longer = n % k;
      std::size_t lo = 0;
      for (std::size_t j = 0; j < k; ++j) {
        const std::size_t length = base + (j < longer ? 1 : 0);
        indices[j] = lo + draw_below(rng, length);
        lo += length;
      }
      // The cheapest per byte join, unless drawn already: each index has one stratum to look in.
      std::array<std::size_t, k_cheapest> cheap;
      const std::size_t found = view.cheapest_per_byte(cheap);
      const std::size_t long_end = longer * (base + 1);  // where the longer strata end
      for (std::size_t j = 0; j < std::min(found, cheap.size()); ++j) {
        const std::size_t i = cheap[j];
        if (i >= n) continue;
        const std::size_t stratum = i < long_end ? i / (base + 1) : longer + (i - long_end) / base;
        if (indices[stratum] != i) indices.push_back(i);
      }
      infos.resize(indices.size());
    }
    view.describe(indices, infos);
  }
};

// The minimum-h candidate of a sample.
struct best_by_h {
  std::optional<buffer_id> id;
  double h = 0;
  std::size_t size = 0;

  void offer(const candidate_info& c, double score) noexcept {
    if (!id || score < h) {
      id = c.id;
      h = score;
      size = c.size;
    }
  }
};

// DTR's choice: the lowest h of a drawn sample.
std::optional<buffer_id> lowest_h(const sample& s) noexcept {
  best_by_h best;
  for (const candidate_info& c : s.infos) best.offer(c, dtr_score(c));
  return best.id;
}

class dtr_policy final : public eviction_policy {
 public:
  explicit dtr_policy(std::uint64_t seed) : rng_(seed) {}
  std::string_view name() const noexcept override { return "dtr"; }

  std::optional<buffer_id> choose(const candidate_view& candidates,
                                  const eviction_request&) override {
    sample_.draw(candidates, rng_);
    return lowest_h(sample_);
  }

 private:
  splitmix64 rng_;
  sample sample_;
};

class dtr_frag_policy final : public eviction_policy {
 public:
  explicit dtr_frag_policy(std::uint64_t seed) : rng_(seed) { scratch_.reserve(256); }
  std::string_view name() const noexcept override { return "dtr-frag"; }

  std::optional<buffer_id> choose(const candidate_view& candidates,
                                  const eviction_request& request) override {
    const std::size_t bytes = request.bytes;
    sample_.draw(candidates, rng_);
    // Within the capacity reserved up front (samples of up to 256: n <= 65,536) this allocates
    // nothing; a larger sample grows it once.
    if (scratch_.size() < sample_.infos.size()) scratch_.resize(sample_.infos.size());
    // Pass 1, no lookups: DTR over the whole sample (tier 4), the best candidate that serves the
    // request in one eviction without a lookup (tier 1: it fits by its own size, or it is a whole
    // segment that covers the shortfall), the best whole segment (tier 3), and the other
    // candidates in the request's stream and pool, kept in scratch_[0, kept). Branch-free after
    // any.offer: which candidates match is random, and the mispredicted branches cost more than
    // the work (about half of a decision, measured).
    const std::size_t shortfall = request.shortfall;
    best_by_h any;
    best_by_h fit;
    best_by_h whole;
    bool matched = false;
    std::size_t kept = 0;
    for (const candidate_info& c : sample_.infos) {
      const double h = dtr_score(c);
      any.offer(c, h);
      const bool in_place = (bytes != 0) & (c.stream == request.stream) & (c.small_pool == request.small_pool);
      const bool frees_segment = (shortfall != 0) & c.whole_segment;
      const bool serves = (in_place & (c.size >= bytes)) | (frees_segment & (c.segment_size >= shortfall));
      const bool better = serves & (!fit.id.has_value() | (h < fit.h));
      fit.h = better ? h : fit.h;
      fit.size = better ? c.size : fit.size;
      if (better) fit.id = c.id;
      const bool better_whole = frees_segment & (!whole.id.has_value() | (h < whole.h));
      whole.h = better_whole ? h : whole.h;
      if (better_whole) whole.id = c.id;
      scratch_[kept] = entry{h, c.size, c.id};
      kept += static_cast<std::size_t>(in_place & !serves);
      matched |= in_place;
    }
    if (!matched) return fit.id ? fit.id : whole.id ? whole.id : any.id;

    // Pass 2: ranges, for the (at most k_max_lookups) lowest-h candidates that could beat `fit`,
    // moved to the front without branches first.
    if (fit.id) {
      std::size_t cheaper = 0;
      for (std::size_t r = 0; r < kept; ++r) {
        const entry e = scratch_[r];
        scratch_[cheaper] = e;
        cheaper += static_cast<std::size_t>(e.h < fit.h);
      }
      kept = cheaper;
    }
    auto end = scratch_.begin() + static_cast<std::ptrdiff_t>(kept);
    if (kept > k_max_lookups) {
      const auto eligible_end = end;
      end = scratch_.begin() + k_max_lookups;
      std::nth_element(scratch_.begin(), end - 1, eligible_end,
                       [](const entry& a, const entry& b) { return a.h < b.h; });
    }
    std::optional<buffer_id> grow;  // tier 2: the highest step, then the smallest h
    std::size_t grow_step = 0;
    std::size_t grow_range = 0;
    std::size_t grow_size = 0;
    double grow_h = 0;
    const double steps_per_byte = static_cast<double>(k_frag_steps) / static_cast<double>(bytes);
    for (auto e = scratch_.begin(); e != end; ++e) {
      if (fit.id && e->h >= fit.h) continue;  // cannot beat the fit we have: skip the lookup
      const std::size_t range = candidates.contiguous_if_evicted(e->id);
      if (range >= bytes) {
        fit.id = e->id;
        fit.h = e->h;
        fit.size = e->size;
        continue;
      }
      // range < bytes: the step is below k_frag_steps (min() guards the double's rounding).
      const std::size_t step = std::min(
          k_frag_steps - 1, static_cast<std::size_t>(static_cast<double>(range) * steps_per_byte));
      if (!grow || step > grow_step || (step == grow_step && e->h < grow_h)) {
        grow = e->id;
        grow_step = step;
        grow_range = range;
        grow_size = e->size;
        grow_h = e->h;
      }
    }
    // A fit against the alternative, by their cost per unit of staleness, h x size (DTR's h is per
    // byte): the fit's, against the evictions the alternative needs (see the top of the file).
    const auto rate = [](double h, std::size_t size) { return h * static_cast<double>(size); };
    const auto evictions = [](std::size_t need, std::size_t each) {
      return std::ceil(static_cast<double>(need) / static_cast<double>(each));
    };
    if (!request.contiguous) {
      // Expandable segments: the cheapest of three ways by rate (the fit on ties): the fit, about
      // bytes / range evictions like `grow`, or, over the budget, about shortfall / granules
      // evictions like DTR's best, counting only the whole granules it frees (one lookup). DTR's
      // best may free none: a small block among live ones (parameters, gradients) in the small
      // pool's segment. Betting on those made ResNet-1202 at 22.5% of peak 180,545 drops.
      std::optional<buffer_id> best = fit.id;
      double best_rate = fit.id ? rate(fit.h, fit.size) : HUGE_VAL;
      if (const double grow_rate = grow ? evictions(bytes, grow_range) * rate(grow_h, grow_size) : HUGE_VAL;
          grow_rate < best_rate) {
        best = grow;
        best_rate = grow_rate;
      }
      if (shortfall > 0 && any.id != best) {
        if (const std::size_t granules = candidates.releasable_if_evicted(*any.id);
            granules > 0 && evictions(shortfall, granules) * rate(any.h, any.size) < best_rate) {
          best = any.id;
        }
      }
      if (best) return best;
      return whole.id ? whole.id : any.id;
    }
    if (fit.id && grow) {  // growing a range in place: about bytes / range evictions like `grow`
      return rate(fit.h, fit.size) <= evictions(bytes, grow_range) * rate(grow_h, grow_size) ? fit.id
                                                                                             : grow;
    }
    if (fit.id && shortfall > 0 && any.id != fit.id &&  // nothing cheaper in place: DTR elsewhere
        rate(fit.h, fit.size) > evictions(shortfall, any.size) * rate(any.h, any.size)) {
      return any.id;  // DTR's bet: the bytes it frees lower the shortfall once segments empty
    }
    if (fit.id) return fit.id;
    if (grow) return grow;
    if (whole.id) return whole.id;
    return any.id;  // every matching candidate was left out of pass 2: cannot happen, but safe
  }

 private:
  struct entry {
    double h;
    std::size_t size;
    buffer_id id;
  };

  splitmix64 rng_;
  sample sample_;
  std::vector<entry> scratch_;  // pass 1's survivors; as large as the largest sample so far
};

}  // namespace

std::unique_ptr<eviction_policy> make_dtr_policy(std::uint64_t seed) {
  return std::make_unique<dtr_policy>(seed);
}

std::unique_ptr<eviction_policy> make_dtr_frag_policy(std::uint64_t seed) {
  return std::make_unique<dtr_frag_policy>(seed);
}

}  // namespace spillway::eviction::detail
