// activation_eviction.cpp: which saved storage to evict, and evicting it (a spill, or a drop its
// checkpoint segment can recompute), by cost. Contract: activation_manager.hpp.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "spillway/size_classes.hpp"

#include "activation_manager_impl.hpp"

namespace spillway::torch_plugin {

using detail::now_seconds;

namespace {
// The index in [0, n) that `better(a, b)` prefers to every other; n > 0.
template <typename Better>
std::size_t best_of(std::size_t n, Better better) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < n; ++i) {
    if (better(i, best)) best = i;
  }
  return best;
}

// Candidates weighed per victim: every one up to this many, else a uniform sample of this many.
// Weighing one asks the allocator three questions under its lock; with every one weighed (and
// every entry scanned for them), a pressure call took about 3 ms at 16,000 saved storages (the
// forward and backward 49 s, against 2.9 s now, on the 2-core development machine's simulated
// device: bench/activation_evict_bench.py). DTR samples too (the engine's dtr: ceil(sqrt(n)),
// Note [Eviction policies]); this sample is larger, since saved storages are bigger and fewer
// than the engine's buffers, and a model of a few hundred is weighed whole as before.
constexpr std::size_t k_weighed = 256;

std::uint64_t split_mix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Times the calls that choose and evict victims (stats: evict_ns).
struct evict_timer {
  std::uint64_t& total;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~evict_timer() {
    total += static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::steady_clock::now() - start)
                                            .count());
  }
};
}  // namespace

bool activation_manager::evictable(const entry& e) const {
  // The entry holds one reference, each alias one: anything more is a user of the storage.
  return e.state == entry_state::resident && e.pins == 0 &&
         e.storage.resizable() && e.storage.allocator() != nullptr &&
         e.storage.use_count() == e.aliases + 1 &&
         (options_.mode != activation_mode::drop || droppable(e));
}

bool activation_manager::droppable(const entry& e) const {
  return e.lineage != nullptr && e.lineage_version.has_value() &&
         detail::version_of(e.version) == e.lineage_version && inputs_unchanged(*e.lineage);
}

std::pair<double, bool> activation_manager::restore_cost(entry& e) {
  const int device = e.device.is_cuda() ? e.device.index() : -1;
  // A storage whose host copy is kept costs only its copy back (a clean eviction, evict_one).
  const double transfer = detail::kept_copy_current(e) ? link_.restore_seconds(e.nbytes, device)
                                                       : link_.spill_seconds(e.nbytes, device);
  if (!droppable(e) || options_.mode == activation_mode::spill) return {transfer, false};
  // Its segment's replay, and those of the dropped segments before it that it needs (a few back:
  // enough to tell a drop that starts a chain of replays from one that does not).
  const double recompute = segment_cost(*e.lineage, /*depth=*/8);
  if (options_.mode == activation_mode::drop) return {recompute, true};
  return recompute <= transfer ? std::pair{recompute, true} : std::pair{transfer, false};
}

double activation_manager::score(entry& e, double now) {
  switch (options_.policy) {
    case activation_policy::lru: return e.last_use;
    case activation_policy::largest: return -static_cast<double>(e.nbytes);
    case activation_policy::dtr: break;
  }
  // DTR: h = cost / (size x staleness); a tiny floor keeps free-to-restore victims ordered.
  return (restore_cost(e).first + 1e-9) /
         (static_cast<double>(e.nbytes) * std::max(now - e.last_use, 1e-6));
}

void activation_manager::swap_resident(std::size_t i, std::size_t j) noexcept {
  std::swap(resident_[i], resident_[j]);
  resident_[i]->resident_at = i;
  resident_[j]->resident_at = j;
}

void activation_manager::became_resident(entry& e) noexcept {
  e.resident_at = resident_.size();
  resident_.push_back(&e);  // within the capacity hold reserves: no allocation
  resident_bytes_ += e.nbytes;
}

void activation_manager::left_resident(entry& e) noexcept {
  swap_resident(e.resident_at, resident_.size() - 1);
  resident_.pop_back();
  resident_bytes_ -= e.nbytes;
}

// Moves to the front of resident_ up to k_weighed victims that may be evicted now, drawn
// uniformly (a partial Fisher-Yates shuffle; every one in turn while there are at most
// k_weighed resident entries), and returns their count; 0: none is left. A victim is evictable
// (checked at every draw: an eviction's own allocations may have run the pressure handler, which
// evicts from the same entries on this thread), not tried already by this call (`tried`: a
// spill that could not be made leaves it resident; a list of the call's own, since a nested
// call tries the same entries), and with `memory_of`, a live allocation of
// it (evicting a CPU storage, or another GPU's, frees nothing there). The scan for them asks the
// allocator nothing until a resident entry is evictable; it draws from the resident entries
// only, so the spilled and dropped ones cost nothing.
std::size_t activation_manager::sample_victims(const device_allocator* memory_of,
                                               const std::vector<entry*>& tried) {
  const std::size_t n = resident_.size();
  std::size_t k = 0;
  for (std::size_t drawn = 0; drawn < n && k < k_weighed; ++drawn) {
    if (n > k_weighed) swap_resident(drawn, drawn + split_mix64(sample_state_) % (n - drawn));
    entry& e = *resident_[drawn];
    if (evictable(e) && std::find(tried.begin(), tried.end(), &e) == tried.end() &&
        (memory_of == nullptr || memory_of->owns(e.storage.data()))) {
      swap_resident(k++, drawn);
    }
  }
  return k;
}

std::size_t activation_manager::pinned_bytes(const device_allocator* memory_of) const {
  std::size_t pinned = 0;
  for (const entry* e : resident_) {
    if (!evictable(*e) && (memory_of == nullptr || memory_of->owns(e->storage.data()))) {
      pinned += e->nbytes;
    }
  }
  return pinned;
}

std::pair<std::size_t, std::size_t> activation_manager::evict(std::size_t wanted,
                                                              const device_allocator* memory_of) {
  std::lock_guard lock(mutex_);
  evict_timer timer{counters_.evict_ns};
  note_copies();  // the link as it is now: what spills cost
  std::vector<entry*> tried;    // could not be evicted by this call
  std::vector<double> scores;  // the policy's, once per sampled victim
  std::size_t freed = 0;
  const double now = now_seconds();
  while (freed < wanted) {
    const std::size_t k = sample_victims(memory_of, tried);
    if (k == 0) break;
    scores.resize(k);
    for (std::size_t i = 0; i < k; ++i) scores[i] = score(*resident_[i], now);
    const std::size_t best = best_of(k, [&](std::size_t a, std::size_t b) { return scores[a] < scores[b]; });
    entry& victim = *resident_[best];
    const std::size_t n = evict_one(victim);
    if (n == 0) tried.push_back(&victim);  // a spill not made, and no drop possible
    freed += n;
  }
  return {freed, pinned_bytes(memory_of)};
}

// Under the allocator's pressure a free range of request.bytes is what serves the request, or,
// past the budget, bytes given back to the device (whole segments; with expandable segments whole
// granules): scattered bytes may serve nothing. So each victim is weighed, among the sampled
// candidates (sample_victims), by what its free would make, as the engine's pressure handler does
// (engine_pressure.cpp):
//   1. a candidate whose free coalesces, with its free and pending-free neighbours, into a range
//      that fits the request on its stream and pool, or whose free gives back what covers the
//      rest of the shortfall, serves it: the best of those by the policy is evicted, and the
//      round ends;
//   2. else the candidate on the request's stream and pool whose free leaves the largest range
//      (in 16ths of the request, the policy breaking ties) is evicted, so that evictions grow one
//      hole rather than many; with none there, the policy's best;
// until max(bytes, shortfall) bytes are freed; the allocator calls again while a round frees
// something (Note [Memory pressure path]). Three allocator questions per sampled candidate and
// victim; the scan for candidates asks none.
std::pair<std::size_t, std::size_t> activation_manager::evict_for(const pressure_request& request,
                                                                  const device_allocator& memory) {
  std::lock_guard lock(mutex_);
  evict_timer timer{counters_.evict_ns};
  note_copies();  // the link as it is now: what spills cost
  std::vector<entry*> tried;  // could not be evicted by this call
  const double now = now_seconds();
  const std::size_t enough = std::max({request.bytes, request.shortfall, std::size_t{1}});
  struct weighed {
    bool serves = false;
    std::size_t bucket = 0;  // the range its free leaves, in 16ths of the request (capped)
    std::size_t gives = 0;   // what its free gives back to the device
    double score = 0;
  };
  std::vector<weighed> w;
  std::size_t freed = 0, released = 0;
  while (freed < enough) {
    const std::size_t k = sample_victims(&memory, tried);
    if (k == 0) break;
    w.assign(k, weighed{});
    for (std::size_t i = 0; i < k; ++i) {
      const void* ptr = resident_[i]->storage.data();
      const allocation_info info = memory.describe(ptr);
      const bool here = info.stream == request.stream &&
                        size_classes::is_small(info.size) == request.small_pool;
      const std::size_t range = here ? memory.coalesced_size_if_freed(ptr) : 0;
      w[i].gives = request.shortfall > 0 ? memory.releasable_if_freed(ptr) : 0;
      w[i].serves = (request.bytes > 0 && range >= request.bytes) ||
                    (request.shortfall > 0 && released + w[i].gives >= request.shortfall);
      w[i].bucket = request.bytes > 0 ? std::min<std::size_t>(range * 16 / request.bytes, 16) : 0;
      w[i].score = score(*resident_[i], now);
    }
    const std::size_t best = best_of(k, [&](std::size_t a, std::size_t b) {
      if (w[a].serves != w[b].serves) return w[a].serves;
      if (!w[a].serves && w[a].bucket != w[b].bucket) return w[a].bucket > w[b].bucket;
      return w[a].score < w[b].score;
    });
    entry& victim = *resident_[best];
    const weighed chosen = w[best];
    const std::size_t n = evict_one(victim);
    if (n == 0) {  // a spill not made (no host memory) and no drop possible
      tried.push_back(&victim);
      continue;
    }
    freed += n;
    released += chosen.gives;
    if (chosen.serves) break;
  }
  // What is pinned only says why a request fails: asked for when this call falls short.
  return {freed, freed < enough ? pinned_bytes(&memory) : 0};
}

std::size_t activation_manager::evict_one(entry& e) {
  const bool clean = detail::kept_copy_current(e);
  if (!clean) let_go_of_host(e);  // written since its restore: the copy kept is stale
  bool drop = restore_cost(e).second;
  // Pinned while its spill allocates: a host allocator served by a budgeted spillway pool may run
  // the pressure handler on this thread, which must not pick this entry too.
  struct spilling {
    entry& e;
    explicit spilling(entry& x) : e(x) { ++e.pins; }
    ~spilling() { --e.pins; }
  } pin{e};
  at::Tensor host;
  if (!drop && !clean) {
    host = spill_buffer(e);
    if (!host.defined()) {  // no host memory for it (max_spilled, or none left): never lose it
      ++counters_.spill_fallbacks;
      if (!droppable(e) || options_.mode == activation_mode::spill) return 0;
      drop = true;  // its segment recomputes it
    }
  }
  if (drop) {
    let_go_of_host(e);
    e.copy.reset();  // a copy back still in flight: the block's free waits for it (copy_in)
    e.state = entry_state::dropped;
    ++counters_.drops;
    counters_.bytes_dropped += e.nbytes;
  } else if (clean) {
    // Restored ahead and not read since: the host copy kept is its bytes. No copy out; the block's
    // free waits for the copy back still writing it, if any (copy_in: record_stream), and the
    // next copy back reads the same host copy.
    spilled_.try_emplace(e.seq, &e);  // may throw: before anything changed
    kept_host_bytes_ -= e.nbytes;
    e.host_version.reset();
    e.state = entry_state::spilled;
    spilled_bytes_ += e.nbytes;
    ++counters_.clean_evictions;
  } else {
    // What may throw (host memory for the map's node and the copy) comes first: if it does, the
    // entry is resident as it was (Note [Host out of memory]).
    const auto slot = spilled_.try_emplace(e.seq, &e).first;
    try {
      copy_out(e, std::move(host));
    } catch (...) {  // copy_out left e.copy as it was (a restore's, still to be waited for)
      spilled_.erase(slot);
      e.host.reset();
      throw;
    }
    e.state = entry_state::spilled;
    spilled_bytes_ += e.nbytes;
    ++counters_.spills;
    counters_.bytes_spilled += e.nbytes;
  }
  if (e.prefetched) prefetch_wasted(e, /*evicted=*/true);  // its copy back was for nothing
  // Where a prefetch asks for room (room_to_prefetch): the allocator that holds its memory now.
  if (pressure_source_ != nullptr) e.home = pressure_source_->holder_of(e.storage.data());
  // Frees the memory (on CUDA in stream order after the copy) and keeps the StorageImpl.
  e.storage.set_data_ptr_noswap(at::DataPtr(nullptr, e.device));
  e.storage.set_nbytes(0);
  e.allocated_on.reset();  // its next block's stream is its next copy back's
  left_resident(e);
  ++counters_.evictions;
  return e.nbytes;
}

}  // namespace spillway::torch_plugin
