// engine_recompute.cpp: dropping buffers and rematerialising them from lineage.
//
// Rematerialisation is recursive: a node's dropped inputs are rematerialised first and stay pinned
// while it runs; every output of the node comes back at once. A node already on the current path
// means a cycle; a path deeper than engine_config::max_recompute_depth means runaway recursion.
// Both are reported with the path, and leave every buffer as it was.
#include <algorithm>

#include "engine_impl.hpp"

namespace spillway::eviction {

using detail::buffer_entry;
using detail::node_entry;

void eviction_engine::impl::make_resident_locked(buffer_entry& e, std::size_t depth) {
  reap_in_flight_locked();
  switch (e.state) {
    case buffer_state::resident:
    case buffer_state::restoring:  // usable in stream order on e.stream already
      return;
    case buffer_state::spilling:
    case buffer_state::spilled:
      restore_locked(e);
      return;
    case buffer_state::dropped:
      if (e.producer == nullptr) {
        throw std::logic_error("spillway: " + describe_id(e.id) +
                               " was dropped but has no lineage to recompute it from");
      }
      recompute_locked(*e.producer, depth);
      return;
  }
}

bool eviction_engine::impl::can_drop_locked(const buffer_entry& e) const noexcept {
  return config.allow_drop && e.producer != nullptr && e.mode != eviction_mode::spill;
}

// Frees the device block; the buffer will be recomputed. Stream order on e.stream makes reuse safe.
void eviction_engine::impl::drop_locked(buffer_entry& e) noexcept {
  by_pointer.erase(e.device_ptr);
  allocator.deallocate(e.device_ptr);
  e.device_ptr = nullptr;
  e.state = buffer_state::dropped;
  ++stats.drops;

  // DTR's e*: the dropped buffer joins the equivalence classes of dropped neighbours.
  if (e.class_parent == nullptr) {  // first drop; a class, once joined, is never split
    e.class_parent = &e;
    e.class_cost_ns = e.producer != nullptr ? e.producer->desc.cost_ns : 0;
  }
  const auto join = [&](buffer_entry* n) {
    if (n == nullptr || n->state != buffer_state::dropped || n->class_parent == nullptr) return;
    buffer_entry* a = class_root(&e);
    buffer_entry* b = class_root(n);
    if (a == b) return;
    b->class_parent = a;
    a->class_cost_ns += b->class_cost_ns;
  };
  if (e.producer != nullptr) {
    for (buffer_entry* in : e.producer->inputs) join(in);
  }
  for (node_entry* consumer : e.consumers) {
    for (buffer_entry* out : consumer->outputs) join(out);
  }
}

buffer_entry* eviction_engine::impl::class_root(buffer_entry* e) noexcept {
  while (e->class_parent != e) {
    e->class_parent = e->class_parent->class_parent;  // path halving
    e = e->class_parent;
  }
  return e;
}

// The summed cost of the distinct dropped classes next to e: its producer's inputs and the
// outputs of the nodes that consume it.
double eviction_engine::impl::neighbourhood_cost_locked(const buffer_entry& e) const {
  buffer_entry* seen[8];
  std::size_t n_seen = 0;
  double cost = 0;
  const auto add = [&](buffer_entry* n) {
    if (n == nullptr || n->state != buffer_state::dropped || n->class_parent == nullptr) return;
    buffer_entry* root = class_root(n);
    for (std::size_t i = 0; i < n_seen; ++i) {
      if (seen[i] == root) return;
    }
    if (n_seen < 8) seen[n_seen++] = root;
    cost += root->class_cost_ns;
  };
  if (e.producer != nullptr) {
    for (buffer_entry* in : e.producer->inputs) add(in);
  }
  for (node_entry* consumer : e.consumers) {
    for (buffer_entry* out : consumer->outputs) add(out);
  }
  return cost;
}

namespace {
// Clears a node's `visiting` mark however the rematerialisation ends.
struct visit_guard {
  node_entry& n;
  explicit visit_guard(node_entry& node) : n(node) { n.visiting = true; }
  ~visit_guard() { n.visiting = false; }
};
}  // namespace

void eviction_engine::impl::recompute_locked(node_entry& n, std::size_t depth) {
  if (n.visiting) {
    throw std::logic_error("spillway: lineage cycle: rematerialising node '" + n.desc.name +
                           "' needs one of its own outputs (directly or through its inputs)");
  }
  if (depth >= config.max_recompute_depth) {
    throw std::logic_error("spillway: rematerialising node '" + n.desc.name + "' needs " +
                           std::to_string(depth) + " levels of lineage, over max_recompute_depth " +
                           std::to_string(config.max_recompute_depth) + " (runaway recursion?)");
  }
  visit_guard visiting(n);

  // 1. Inputs: resident and pinned for the duration of the call, ordered before n.stream.
  std::vector<buffer_entry*> pinned;
  struct unpin_all {
    impl& m;
    std::vector<buffer_entry*>& list;
    ~unpin_all() {
      for (buffer_entry* e : list) m.unpin_locked(*e);
    }
  } unpin{*this, pinned};
  pinned.reserve(n.inputs.size());
  std::vector<void*> input_ptrs;
  input_ptrs.reserve(n.inputs.size());
  for (buffer_entry* in : n.inputs) {
    make_resident_locked(*in, depth + 1);
    pin_locked(*in);
    pinned.push_back(in);
    if (in->stream != n.stream) order_after_locked(n.stream, in->stream);
    input_ptrs.push_back(in->device_ptr);
  }

  // 2. Outputs: a fresh block for each output that is not resident, scratch for those that are
  //    (and for outputs that were forgotten): recomputing writes every output.
  std::vector<void*> output_ptrs(n.outputs.size(), nullptr);
  std::vector<void*> scratch;
  struct free_scratch {
    device_allocator& a;
    std::vector<void*>& list;
    ~free_scratch() {
      for (void* p : list) a.deallocate(p);
    }
  } scratch_guard{allocator, scratch};
  std::vector<buffer_entry*> fresh(n.outputs.size(), nullptr);
  try {
    for (std::size_t k = 0; k < n.outputs.size(); ++k) {
      buffer_entry* out = n.outputs[k];
      const bool resident = out != nullptr && (out->state == buffer_state::resident ||
                                               out->state == buffer_state::restoring);
      if (out != nullptr && out->pins == 0 && resident && candidates.contains(*out)) {
        candidates.erase(*out);  // not evictable while its siblings are being made
      }
      scratch.reserve(scratch.size() + 1);
      void* p = allocate_locked(out != nullptr ? out->size : n.output_sizes[k], n.stream);
      output_ptrs[k] = p;
      if (resident || out == nullptr) {
        scratch.push_back(p);
      } else {
        fresh[k] = out;
      }
    }
  } catch (...) {
    for (std::size_t k = 0; k < fresh.size(); ++k) {
      if (fresh[k] != nullptr) allocator.deallocate(output_ptrs[k]);
    }
    for (buffer_entry* out : n.outputs) {
      if (out != nullptr) update_candidacy_locked(*out);
    }
    throw;
  }

  // 3. Run it.
  try {
    n.desc.compute(input_ptrs, output_ptrs, n.stream);
  } catch (...) {
    for (std::size_t k = 0; k < fresh.size(); ++k) {
      if (fresh[k] != nullptr) allocator.deallocate(output_ptrs[k]);
    }
    for (buffer_entry* out : n.outputs) {
      if (out != nullptr) update_candidacy_locked(*out);
    }
    throw;
  }
  ++stats.recomputes;
  stats.recompute_cost_ns += n.desc.cost_ns;

  // 4. Every output that was not resident is resident now, at its new block.
  for (std::size_t k = 0; k < fresh.size(); ++k) {
    buffer_entry* out = fresh[k];
    if (out == nullptr) continue;
    discard_host_copy_locked(*out);  // a spilled output's host copy is no longer needed
    out->device_ptr = output_ptrs[k];
    by_pointer.emplace(out->device_ptr, out);
    if (out->stream != n.stream) order_after_locked(out->stream, n.stream);
    out->state = buffer_state::resident;
    stats.bytes_recomputed += out->size;
  }
  for (buffer_entry* out : n.outputs) {
    if (out != nullptr) update_candidacy_locked(*out);
  }
}

}  // namespace spillway::eviction
