// activation_eviction.cpp: which saved storage to evict, and evicting it (a spill, or a drop its
// checkpoint segment can recompute), by cost. Contract: activation_manager.hpp.
#include <algorithm>

#include "activation_manager_impl.hpp"

namespace spillway::torch_plugin {

using detail::now_seconds;

bool activation_manager::evictable(const entry& e) const {
  // The entry holds one reference, each alias one: anything more is a user of the storage.
  return e.state == entry_state::resident && e.pins == 0 && !e.copy &&
         e.storage.resizable() && e.storage.allocator() != nullptr &&
         e.storage.use_count() == e.aliases + 1 &&
         (options_.mode != activation_mode::drop || e.lineage != nullptr);
}

std::pair<double, bool> activation_manager::restore_cost(entry& e) {
  const double transfer = 2.0 * static_cast<double>(e.nbytes) / options_.link_bandwidth;
  if (!e.lineage || options_.mode == activation_mode::spill) return {transfer, false};
  // Its segment's replay, and those of the dropped segments before it that it needs (a few back:
  // enough to tell a drop that starts a chain of replays from one that does not).
  const double recompute = segment_cost(*e.lineage, /*depth=*/8);
  if (options_.mode == activation_mode::drop) return {recompute, true};
  return recompute <= transfer ? std::pair{recompute, true} : std::pair{transfer, false};
}

activation_manager::entry* activation_manager::choose(std::vector<entry*>& candidates, double now) {
  auto score = [&](entry* e) -> double {
    switch (options_.policy) {
      case activation_policy::lru: return e->last_use;
      case activation_policy::largest: return -static_cast<double>(e->nbytes);
      case activation_policy::dtr: break;
    }
    // DTR: h = cost / (size x staleness); a tiny floor keeps free-to-restore victims ordered.
    return (restore_cost(*e).first + 1e-9) /
           (static_cast<double>(e->nbytes) * std::max(now - e->last_use, 1e-6));
  };
  std::size_t best = 0;
  double best_score = score(candidates[0]);
  for (std::size_t i = 1; i < candidates.size(); ++i) {
    const double s = score(candidates[i]);  // once per candidate
    if (s < best_score) {
      best = i;
      best_score = s;
    }
  }
  entry* victim = candidates[best];
  candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(best));
  return victim;
}

std::pair<std::size_t, std::size_t> activation_manager::evict(std::size_t wanted,
                                                              const device_allocator* memory_of) {
  std::lock_guard lock(mutex_);
  const auto in_scope = [memory_of](const entry& e) {
    return memory_of == nullptr ||
           (e.state == entry_state::resident && memory_of->owns(e.storage.data()));
  };
  std::vector<entry*> candidates;
  for (auto& [key, e] : entries_) {
    if (evictable(*e) && in_scope(*e)) candidates.push_back(e.get());
  }
  std::size_t freed = 0;
  const double now = now_seconds();
  while (freed < wanted && !candidates.empty()) {
    // Checked again: an eviction's own allocations (a spill's host copy on the CPU) may run the
    // pressure handler, which evicts from the same entries on this thread.
    entry& victim = *choose(candidates, now);
    if (evictable(victim)) freed += evict_one(victim);
  }
  std::size_t pinned = 0;
  for (auto& [key, e] : entries_) {
    if (e->state == entry_state::resident && !evictable(*e) && in_scope(*e)) pinned += e->nbytes;
  }
  return {freed, pinned};
}

std::size_t activation_manager::evict_one(entry& e) {
  bool drop = restore_cost(e).second;
  at::Tensor host;
  if (!drop) {
    host = spill_buffer(e);
    if (!host.defined()) {  // no host memory for it (max_spilled, or none left): never lose it
      ++counters_.spill_fallbacks;
      if (e.lineage == nullptr || options_.mode == activation_mode::spill) return 0;
      drop = true;  // its segment recomputes it
    }
  }
  if (drop) {
    e.state = entry_state::dropped;
    ++counters_.drops;
    counters_.bytes_dropped += e.nbytes;
  } else {
    copy_out(e, std::move(host));
    e.state = entry_state::spilled;
    spilled_[e.seq] = &e;
    spilled_bytes_ += e.nbytes;
    ++counters_.spills;
    counters_.bytes_spilled += e.nbytes;
  }
  // Frees the memory (on CUDA in stream order after the copy) and keeps the StorageImpl.
  e.storage.set_data_ptr_noswap(at::DataPtr(nullptr, e.device));
  e.storage.set_nbytes(0);
  resident_bytes_ -= e.nbytes;
  ++counters_.evictions;
  return e.nbytes;
}

}  // namespace spillway::torch_plugin
