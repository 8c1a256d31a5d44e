// engine_pressure.cpp: the allocator's pressure handler — choose victims, evict them, until the
// pending allocation can be served.
//
// The handler frees a contiguous range that fits the request when it can: each victim on the
// request's stream and pool is checked with coalesced_size_if_freed before it is evicted, and the
// round ends as soon as one range fits. Otherwise victims help through what their free gives back
// to the device (releasable_if_freed): a whole segment they empty, with fixed segments, or the
// whole granules they free, with expandable ones (those are unmapped and mapped again where the
// request goes). So a round also ends once that covers the shortfall, or, failing both, once its
// victims add up to max(request, shortfall) bytes; the allocator calls again if that was not
// enough. Before any victim, compaction (engine_compaction.cpp) may empty segments by moving
// buffers: those count towards the shortfall, and the blocks moved out towards result.freed
// (they were freed), not towards the victims' bytes.
// (Until 2026-11-22 only a victim that was its whole segment counted, as cached when it was
// registered: with expandable segments a round freed up to the whole request, not its shortfall.)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <span>

#include "engine_impl.hpp"

namespace spillway::eviction {

using detail::buffer_entry;

namespace {

// The candidates as records (registry.hpp: candidate_record): describing one reads its record
// only, and describe() fills a whole sample in one call, so a decision costs one virtual call
// and one cache line per sampled candidate.
class engine_candidate_view final : public candidate_view {
 public:
  engine_candidate_view(const eviction_engine::impl& m, std::uint64_t now) : m_(m), now_(now) {}

  std::size_t count() const override { return m_.candidates.size(); }
  candidate_info at(std::size_t i) const override {
    return m_.describe_candidate_locked(m_.candidates.at(i), now_);
  }
  void describe(std::span<const std::size_t> indices, std::span<candidate_info> out) const override {
    const std::size_t n = std::min(indices.size(), out.size());
    // The sampled records are scattered over the candidate vector and, between decisions, the
    // rest of the program pushes them (and the policy's output array) out of the cache: ask for
    // all of them first, so that their misses overlap instead of being paid one after another
    // (most of a decision's time, measured).
    for (std::size_t k = 0; k < n; ++k) {
      __builtin_prefetch(&m_.candidates.at(indices[k]));
      __builtin_prefetch(&out[k], 1);
    }
    for (std::size_t k = 0; k < n; ++k) {
      out[k] = m_.describe_candidate_locked(m_.candidates.at(indices[k]), now_);
    }
  }
  std::optional<candidate_info> least_recently_used() const override {
    const buffer_entry* e = m_.candidates.oldest();
    if (e == nullptr) return std::nullopt;
    return m_.describe_candidate_locked(m_.candidates.record(*e), now_);
  }
  std::size_t cheapest_per_byte(std::span<std::size_t> out) const override {
    return m_.candidates.cheapest_per_byte(out);
  }
  std::optional<candidate_info> largest() const override {
    const buffer_entry* e = m_.candidates.largest();
    if (e == nullptr) return std::nullopt;
    return m_.describe_candidate_locked(m_.candidates.record(*e), now_);
  }
  std::size_t contiguous_if_evicted(buffer_id id) const override {
    const void* p = device_ptr_of(id);
    return p != nullptr ? m_.allocator.coalesced_size_if_freed(p) : 0;
  }
  std::size_t releasable_if_evicted(buffer_id id) const override {
    const void* p = device_ptr_of(id);
    return p != nullptr ? m_.allocator.releasable_if_freed(p) : 0;
  }

 private:
  const void* device_ptr_of(buffer_id id) const {
    const buffer_entry* e = m_.buffers.find(id.value);
    return e != nullptr ? e->device_ptr : nullptr;
  }

  const eviction_engine::impl& m_;
  std::uint64_t now_;
};

double elapsed_ns(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

// The cost model's choice for the candidate, from its record alone.
candidate_info eviction_engine::impl::describe_candidate_locked(const detail::candidate_record& r,
                                                                std::uint64_t now) const noexcept {
  candidate_info c;
  c.id = r.id;
  c.size = r.size;
  c.stream = r.stream;
  c.small_pool = r.small_pool;
  c.segment_size = r.segment_size;
  c.whole_segment = r.whole_segment;
  c.staleness_ns = now > r.last_access_ns ? static_cast<double>(now - r.last_access_ns) : 1.0;
  if (r.next_read != detail::access_profile::no_event) {
    c.next_use_ns = access.distance_ns(r.next_read);
    // The dependants' read, if earlier, may be the current event's (a recompute under way, which
    // holds what it reads) or one that did not come: then its own read counts.
    if (std::isnan(c.next_use_ns) && r.next_read != r.entry->next_read) {
      c.next_use_ns = access.distance_ns(r.entry->next_read);
    }
  }
  double neighbourhood = r.can_drop ? r.neighbourhood_ns : 0;
  if (wanted_now_entries > 0 && r.entry->wanted_now) describe_wanted_now_locked(*r.entry, c, neighbourhood);
  // The record's flags already include its mode; only a buffer that may go either way needs the
  // cost model's comparison (the common drop-only and spill-only cases skip it). A spill the host
  // pool has no room for is none: it would fail, and the buffer be dropped at its full cost.
  const bool can_spill = r.can_spill && host_pool::round_size(r.size) <= host_room;
  const eviction_action action =
      r.can_drop && can_spill
          ? costs->choose(r.mode, r.size, d2h_queued_bytes, true, true, r.recompute_ns, neighbourhood)
          : r.can_drop ? eviction_action::drop
                       : can_spill ? eviction_action::spill : eviction_action::none;
  switch (action) {
    case eviction_action::drop:
      c.cost_ns = r.recompute_ns;
      c.neighbourhood_cost_ns = neighbourhood;
      break;
    case eviction_action::spill:
      c.cost_ns = costs->spill_cost_ns(r.size, d2h_queued_bytes);
      break;
    case eviction_action::none:
      c.cost_ns = 1e30;  // a last resort
      break;
  }
  return c;
}

double eviction_engine::impl::cost_per_byte_locked(const detail::candidate_record& r) const noexcept {
  // Not droppable: infinite, never joined. The join is for DTR's neighbourhood, which only drops
  // have; a spill costs about the same per byte whatever the buffer (the link's bandwidth), and its
  // cheapest per byte would only be the largest buffers (with spills alone, one synth:resnet run at
  // 60% of peak took 3.877x -> 4.749x with them joined, on the simulated device).
  if (!r.can_drop) return std::numeric_limits<double>::infinity();
  const double cost = static_cast<double>(r.recompute_ns) + static_cast<double>(r.neighbourhood_ns);
  const double per_byte = cost / static_cast<double>(std::max<std::size_t>(1, r.size));
  return std::isnan(per_byte) ? std::numeric_limits<double>::infinity() : per_byte;
}

// A buffer that a pin_together which let its pins go is taking again (Note [Pinning together lets
// go to fit]) is needed by the op under way: its next use is now, however long ago it was last
// read, and if every input of its producer is at hand or taken in the same call, recomputing it
// costs its own node only, run after them: the dropped classes next to it are being rebuilt
// anyway.
void eviction_engine::impl::describe_wanted_now_locked(const buffer_entry& e, candidate_info& c,
                                                       double& neighbourhood) const noexcept {
  c.next_use_ns = 0;
  if (e.producer == nullptr) return;
  const bool inputs_at_hand =
      std::all_of(e.producer->inputs.begin(), e.producer->inputs.end(), [](const buffer_entry* in) {
        return in->wanted_now || in->state != buffer_state::dropped;
      });
  if (inputs_at_hand) neighbourhood = 0;
}

pressure_result pressure_gate::call(const pressure_request& request) {
  {
    std::lock_guard lock(mutex);
    if (closed) return {};  // the engine is being destroyed: it frees nothing more
    ++calls;
  }
  struct leave {
    pressure_gate& g;
    ~leave() {
      std::lock_guard lock(g.mutex);
      if (--g.calls == 0 && g.closed) g.idle.notify_all();
    }
  } guard{*this};
  return engine->on_pressure(request);
}

void pressure_gate::close() noexcept {
  std::unique_lock lock(mutex);
  closed = true;
  idle.wait(lock, [this] { return calls == 0; });
}

pressure_result eviction_engine::impl::on_pressure(const pressure_request& r) {
  eviction_request request;
  request.stream = r.stream;
  request.bytes = r.bytes;
  request.small_pool = r.small_pool;
  request.shortfall = r.shortfall;
  request.contiguous = r.contiguous;
  // An allocation made by the engine itself (restore, recompute) calls back on this thread, which
  // holds the engine lock already. See Note [Eviction lock order].
  if (lock_owner.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    return evict_for_locked(request);
  }
  engine_lock lock(*this);
  return evict_for_locked(request);
}

pressure_result eviction_engine::impl::evict_for_locked(const eviction_request& request) {
  ++stats.pressure_calls;
  reap_in_flight_locked();
  pressure_result result;
  // Segments emptied, granules freed: the allocator gives them back. Moving buffers out of the
  // segments cheapest to empty comes first, and may cover the shortfall alone.
  std::size_t released = compact_for_locked(request, result);
  if (request.shortfall > 0 && released >= request.shortfall) {
    result.pinned = stats.pinned_bytes;
    return result;
  }
  // Could not be evicted now: candidates again afterwards, however the loop ends (out of host
  // memory in a policy, say). Their slots in the candidates stay reserved, so that cannot throw.
  std::vector<buffer_entry*> skipped;
  struct restore_skipped {
    impl& m;
    std::vector<buffer_entry*>& list;
    ~restore_skipped() {
      for (buffer_entry* e : list) {
        try {
          m.update_candidacy_locked(*e);
        } catch (...) {
        }
      }
    }
  } restore{*this, skipped};
  const std::size_t enough = std::max(request.bytes, request.shortfall);
  std::size_t evicted = 0;  // result.freed counts the blocks moved out too, which free nothing
  const engine_candidate_view view(*this, now());

  while (candidates.size() > 0) {
    settle_cost_order_locked();  // upkeep deferred to here: not the decision's time
    host_room = host.room();
    const auto started = std::chrono::steady_clock::now();
    const std::optional<buffer_id> choice = policy->choose(view, request);
    stats.decision_time_ns += elapsed_ns(started);
    ++stats.decisions;
    buffer_entry* victim = choice ? buffers.find(choice->value) : nullptr;
    if (victim == nullptr || !candidates.contains(*victim)) break;

    const bool serves_request = request.bytes > 0 && victim->block_stream == request.stream &&
                                victim->small_pool == request.small_pool;
    const std::size_t contiguous =
        serves_request ? allocator.coalesced_size_if_freed(victim->device_ptr) : 0;
    // What its free gives back to the device: its segment if that empties (fixed segments), or
    // the whole granules it frees (expandable segments: those serve the request wherever they are).
    // Looked up only when a shortfall can use it (one allocator lookup, under its lock).
    const std::size_t releasable =
        request.shortfall > 0 ? allocator.releasable_if_freed(victim->device_ptr) : 0;
    if (!evict_locked(*victim, victim->mode)) {
      skipped.push_back(victim);  // may throw: while it is still a candidate
      if (candidates.contains(*victim)) candidates.erase(*victim);
      continue;
    }
    result.freed += victim->size;
    evicted += victim->size;
    if (serves_request && contiguous >= request.bytes) break;
    released += releasable;
    if (request.shortfall > 0 && released >= request.shortfall) break;
    if (evicted >= enough) break;
  }
  result.pinned = stats.pinned_bytes;
  return result;
}

// Evicts one resident, unpinned buffer by the cost model's choice; false if neither way works.
bool eviction_engine::impl::evict_locked(buffer_entry& e, eviction_mode mode) {
  if (candidates.contains(e)) candidates.erase(e);
  // However this ends (evicted, refused, or out of host memory), e is a candidate again exactly
  // when it is still resident and unpinned. Its slot stays reserved: that cannot throw.
  struct recandidate {
    impl& m;
    buffer_entry& e;
    ~recandidate() {
      try {
        m.update_candidacy_locked(e);
      } catch (...) {
      }
    }
  } guard{*this, e};
  const bool can_drop = can_drop_locked(e) && mode != eviction_mode::spill;
  const bool can_spill = config.allow_spill && e.mode != eviction_mode::drop &&
                         mode != eviction_mode::drop && host_pool::round_size(e.size) <= host.room();
  const double recompute = e.producer != nullptr ? e.producer->desc.cost_ns : 0;
  // The neighbourhood the policy was shown (Note [Pinning together lets go to fit]): the choice
  // between spill and drop weighs what the victim was chosen on.
  double neighbourhood = can_drop ? charged_neighbourhood_locked(e) : 0;
  if (wanted_now_entries > 0 && e.wanted_now) {
    candidate_info unused;
    describe_wanted_now_locked(e, unused, neighbourhood);
  }
  const eviction_action action =
      costs->choose(mode, e.size, d2h_queued_bytes, can_spill, can_drop, recompute, neighbourhood);
  bool done = false;
  if (action == eviction_action::spill) {
    done = spill_locked(e);
    if (!done && can_drop) {  // no pinned memory (or a copy fault): recompute it later instead
      drop_locked(e);
      done = true;
    }
  } else if (action == eviction_action::drop) {
    drop_locked(e);
    done = true;
  }
  if (!done) return false;
  ++stats.evictions;
  return true;
}

void* eviction_engine::impl::allocate_locked(std::size_t bytes, stream_ref stream) {
  return allocator.allocate(bytes, stream);  // may call on_pressure on this thread
}

}  // namespace spillway::eviction
