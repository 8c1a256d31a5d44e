// engine_recompute.cpp: dropping buffers and rematerialising them from lineage.
//
// Rematerialisation: plan_recompute_locked lists the nodes to run — the producer of the buffer
// asked for and, transitively, the producers of dropped inputs — producers before consumers, and
// rematerialise_locked runs them one after another, so a deep lineage costs no stack. Each node's
// inputs are resident and pinned while it runs; an output that a later node of the plan reads
// stays pinned until that node has run; every output of a node comes back at once. A node already
// on the current path means a cycle; a path deeper than engine_config::max_recompute_depth means
// runaway recursion. The plan finds both before anything is restored or allocated, and reports
// them with the nodes on the path; nothing has changed then. (Evictions made while the plan runs
// can drop an input that the plan saw resident: recompute_locked then rematerialises it first,
// with a plan of its own, one level deeper.)
#include <algorithm>
#include <cstdio>
#include <limits>
#include <unordered_map>
#include <unordered_set>

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
      rematerialise_locked(*e.producer, depth);
      return;
  }
}

// The nodes to run to rematerialise `top`'s outputs, producers first and `top` last: a depth-first
// walk over the producers of dropped inputs that changes nothing and throws what running it
// would meet: a cycle, a path deeper than max_recompute_depth (counting `depth` levels above
// `top`), a dropped buffer without lineage. Iterative; each node is listed once.
std::vector<node_entry*> eviction_engine::impl::plan_recompute_locked(node_entry& top,
                                                                    std::size_t depth) {
  struct frame {
    node_entry* n;
    std::size_t next_input;
  };
  std::vector<frame> path;
  struct clear_marks {  // `visiting` marks the nodes on the path, however the walk ends
    std::vector<frame>& path;
    ~clear_marks() {
      for (frame& f : path) f.n->visiting = false;
    }
  } clear{path};
  std::vector<node_entry*> plan;
  std::unordered_set<const node_entry*> done;
  const auto push = [&](node_entry& n) {
    if (n.visiting) {  // on the path (or running: the walk started inside its recompute)
      std::string cycle;
      bool on_cycle = false;
      for (const frame& g : path) {
        on_cycle = on_cycle || g.n == &n;
        if (on_cycle) cycle += "'" + g.n->desc.name + "' -> ";
      }
      throw std::logic_error("spillway: lineage cycle: rematerialising node '" + top.desc.name +
                             "' needs one of its own outputs: " + cycle + "'" + n.desc.name + "'");
    }
    if (depth + path.size() >= config.max_recompute_depth) {
      throw std::logic_error("spillway: rematerialising node '" + top.desc.name + "' needs over " +
                             std::to_string(config.max_recompute_depth) +
                             " levels of lineage (max_recompute_depth " +
                             std::to_string(config.max_recompute_depth) + "), down to node '" +
                             n.desc.name + "' (runaway recursion?)");
    }
    path.push_back({&n, 0});
    n.visiting = true;
  };
  push(top);
  while (!path.empty()) {
    frame& f = path.back();
    if (f.next_input == f.n->inputs.size()) {
      f.n->visiting = false;
      done.insert(f.n);
      plan.push_back(f.n);
      path.pop_back();
      continue;
    }
    const buffer_entry& in = *f.n->inputs[f.next_input++];
    if (in.state != buffer_state::dropped) continue;
    node_entry* p = in.producer;
    if (p == nullptr) {
      throw std::logic_error("spillway: " + describe_id(in.id) +
                             " was dropped but has no lineage to recompute it from");
    }
    if (done.count(p) == 0) push(*p);  // `f` is not used after this
  }
  return plan;
}

// Runs the plan for `top`. A node whose outputs are no longer dropped (an earlier node of the
// plan made them, or they were never needed by it) is skipped.
void eviction_engine::impl::rematerialise_locked(node_entry& top, std::size_t depth) {
  // `depth` counts the plans this one runs inside: each level is a few frames of stack.
  if (depth >= config.max_nested_plans) throw_nested_plans_locked(top, depth);
  const std::vector<node_entry*> plan = plan_recompute_locked(top, depth);
  std::unordered_map<const node_entry*, std::size_t> position;
  for (std::size_t i = 0; i < plan.size(); ++i) position.emplace(plan[i], i);

  struct held_output {
    buffer_entry* e;
    std::size_t until;  // the position of the last node of the plan that reads it
  };
  std::vector<held_output> held;
  struct unpin_held {
    impl& m;
    std::vector<held_output>& list;
    ~unpin_held() {
      for (held_output& h : list) m.unpin_locked(*h.e);
    }
  } unpin{*this, held};

  for (std::size_t i = 0; i < plan.size(); ++i) {
    node_entry& n = *plan[i];
    const bool needed = std::any_of(n.outputs.begin(), n.outputs.end(), [](const buffer_entry* o) {
      return o != nullptr && o->state == buffer_state::dropped;
    });
    if (needed) {
      try {
        recompute_locked(n, depth);
      } catch (const thrashing&) {
        throw;  // not for want of room: the same node, the same count, the same refusal
      } catch (const out_of_memory&) {
        // The outputs held for later nodes are what keeps this one from fitting: let them be
        // evicted (a later node that finds one dropped rematerialises it again), and try once
        // more. Note [Recompute plans hold their outputs].
        if (held.empty()) throw;
        for (held_output& h : held) unpin_locked(*h.e);
        held.clear();
        ++stats.plan_holds_released;
        recompute_locked(n, depth);
      }
      for (buffer_entry* out : n.outputs) {
        if (out == nullptr) continue;
        std::size_t until = i;
        for (const node_entry* c : out->consumers) {
          const auto it = position.find(c);
          if (it != position.end() && it->second > until) until = it->second;
        }
        if (until == i) continue;
        reserve_one_more(held);
        pin_locked(*out);
        held.push_back({out, until});
      }
    }
    for (std::size_t k = 0; k < held.size();) {  // outputs that no later node reads
      if (held[k].until == i) {
        unpin_locked(*held[k].e);
        held[k] = held.back();
        held.pop_back();
      } else {
        ++k;
      }
    }
  }
}

bool eviction_engine::impl::can_drop_locked(const buffer_entry& e) const noexcept {
  return config.allow_drop && e.producer != nullptr && e.mode != eviction_mode::spill;
}

// Frees the device block; the buffer will be recomputed. Stream order on e.stream makes reuse safe.
void eviction_engine::impl::drop_locked(buffer_entry& e) noexcept {
  by_pointer.erase(e.device_ptr);
  allocator.deallocate(e.device_ptr);  // after the work of its use streams (record_stream)
  e.device_ptr = nullptr;
  e.use_streams.clear();
  set_state_locked(e, buffer_state::dropped);  // joins the dropped buffers next to it (DTR's e*)
  ++stats.drops;
}

namespace {
// Clears a node's `visiting` mark however the rematerialisation ends.
struct visit_guard {
  node_entry& n;
  explicit visit_guard(node_entry& node) : n(node) { n.visiting = true; }
  ~visit_guard() { n.visiting = false; }
};
}  // namespace

// What a thrashing error reports: the device, budget, reserved, allocated and pinned bytes.
out_of_memory::details eviction_engine::impl::thrashing_details_locked() const {
  const memory_stats st = allocator.stats();
  out_of_memory::details d;
  d.device = allocator.device();
  d.budget = allocator.budget();
  d.allocated = static_cast<std::size_t>(st.allocated_bytes[0].current);
  d.reserved = static_cast<std::size_t>(st.reserved_bytes[0].current);
  d.pinned = stats.pinned_bytes;
  return d;
}

// Plans nested past max_nested_plans: each found an input of its node evicted again before the
// node ran, under pressure that lets go of what the plans hold. Thrashing, before the stack runs out.
void eviction_engine::impl::throw_nested_plans_locked(const node_entry& top, std::size_t depth) const {
  const out_of_memory::details d = thrashing_details_locked();
  throw thrashing("spillway: thrashing on device " + std::to_string(d.device) + ": rematerialising node '" +
                      top.desc.name + "' needs a recompute plan inside " + std::to_string(depth) +
                      " others (max_nested_plans " + std::to_string(config.max_nested_plans) +
                      "): each one's inputs were evicted again before its node ran. " +
                      std::to_string(d.reserved) + " bytes reserved, " + std::to_string(d.allocated) +
                      " allocated: raise the budget, allow spilling, or raise max_nested_plans",
                  d);
}

// Note [Thrashing bound]: running n again would take the caller's pin past max_recompute_factor
// times the cost of the whole lineage. Nothing has changed for n yet; the exception unwinds like
// an allocation's out_of_memory (pins let go, scratch freed, dropped buffers left dropped).
void eviction_engine::impl::check_thrashing_locked(const node_entry& n) const {
  // Cost, and also count: nodes whose cost is 0 (or measured as next to nothing) would never pass
  // a bound on cost alone.
  const double factor = config.max_recompute_factor;
  if (factor == 0) return;
  if (call_recompute_ns + n.desc.cost_ns <= factor * lineage_cost_ns &&
      static_cast<double>(call_recomputes + 1) <= factor * static_cast<double>(lineage_nodes)) {
    return;
  }
  const out_of_memory::details d = thrashing_details_locked();
  char budget[48] = "no budget";
  if (d.budget != std::numeric_limits<std::size_t>::max()) {
    std::snprintf(budget, sizeof budget, "budget %zu bytes", d.budget);
  }
  char what[1024];
  std::snprintf(what, sizeof what,
                "spillway: thrashing on device %d: this pin has run %zu lineage nodes (%.6g ms), "
                "and running '%s' again would pass max_recompute_factor %g x the whole lineage "
                "(%zu nodes, %.6g ms): what it rebuilds is evicted again to make room for the "
                "rest. %s, %zu bytes reserved, %zu allocated: raise the budget, allow spilling, "
                "or raise max_recompute_factor",
                d.device, call_recomputes, call_recompute_ns / 1e6, n.desc.name.c_str(), factor,
                lineage_nodes, lineage_cost_ns / 1e6, budget, d.reserved, d.allocated);
  throw thrashing(what, d);
}

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
  check_thrashing_locked(n);

  // 1. Inputs: resident and pinned for the duration of the call (together: bringing back one
  //    never evicts another), ordered before n.stream.
  std::vector<void*> input_ptrs;
  input_ptrs.reserve(n.inputs.size());
  pin_together_locked(n.inputs, depth + 1);
  struct unpin_all {
    impl& m;
    const std::vector<buffer_entry*>& list;
    ~unpin_all() {
      for (buffer_entry* e : list) m.unpin_locked(*e);
    }
  } unpin{*this, n.inputs};
  for (buffer_entry* in : n.inputs) {
    // n reads it on n.stream, as pin(id, n.stream) would: ordered after its stream, its block's
    // free waiting for n.stream, and n.stream among its use_streams (compaction moves such a
    // buffer only as a last resort: Note [Compaction]).
    use_on_stream_locked(*in, n.stream);
    // And after the streams of pin(id, use), which may have written it (as a spill waits).
    for (stream_ref s : in->use_streams) {
      if (s != n.stream) order_after_locked(n.stream, s);
    }
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
  // An output found resident or being restored gets a scratch block, and is held like a pin
  // (without counting as a use) from then until the call ends: a later output's allocation may
  // call the pressure handler back, and a restoring one its reap makes resident would be a
  // candidate again, evicted while its sibling is made (and the plan would pin it evicted).
  // Before its turn it may be evicted like any candidate: it is then made fresh, which costs
  // nothing more (the node writes every output) and needs no scratch.
  struct hold_outputs {
    impl& m;
    std::vector<buffer_entry*> list;
    ~hold_outputs() {
      for (buffer_entry* e : list) m.release_hold_locked(*e);
    }
  } held_outputs{*this, {}};
  held_outputs.list.reserve(n.outputs.size());
  // On failure before the node's work is queued: the fresh blocks go back (and out of by_pointer,
  // where step 3 may have entered them), the outputs are candidates again as they were.
  const auto give_back = [&] {
    for (std::size_t k = 0; k < fresh.size(); ++k) {
      if (fresh[k] == nullptr) continue;
      by_pointer.erase(output_ptrs[k]);  // a fresh block: no other buffer has its pointer
      allocator.deallocate(output_ptrs[k]);
    }
    for (buffer_entry* out : n.outputs) {
      if (out != nullptr) update_candidacy_locked(*out);
    }
  };
  try {
    for (std::size_t k = 0; k < n.outputs.size(); ++k) {
      buffer_entry* out = n.outputs[k];
      const bool resident = out != nullptr && (out->state == buffer_state::resident ||
                                               out->state == buffer_state::restoring);
      if (resident) {
        hold_locked(*out);
        held_outputs.list.push_back(out);  // reserved: cannot throw
      }
      reserve_one_more(scratch);
      void* p = allocate_locked(out != nullptr ? out->size : n.output_sizes[k], n.stream);
      output_ptrs[k] = p;
      if (resident || out == nullptr) {
        scratch.push_back(p);
      } else {
        fresh[k] = out;
      }
    }
  } catch (...) {
    give_back();
    throw;
  }

  // 3. What may fail is done before the call: every fresh block is known by its pointer and
  //    recorded for the stream its output lives on (the candidates have a slot for every
  //    buffer record). After the call nothing may fail half-way, since the queued compute
  //    writes every output.
  try {
    for (std::size_t k = 0; k < fresh.size(); ++k) {
      buffer_entry* out = fresh[k];
      if (out == nullptr) continue;
      by_pointer.emplace(output_ptrs[k], out);
      if (out->stream != n.stream) allocator.record_stream(output_ptrs[k], out->stream);
    }
    n.desc.compute(input_ptrs, output_ptrs, n.stream);
  } catch (...) {
    give_back();
    throw;
  }
  ++stats.recomputes;
  stats.recompute_cost_ns += n.desc.cost_ns;
  call_recompute_ns += n.desc.cost_ns;
  ++call_recomputes;
  // The node's work is queued, not done: the clock has not moved, but its outputs are as fresh
  // as its cost makes them (Note [Staleness clock]).
  recompute_time_floor = now() + static_cast<std::uint64_t>(n.desc.cost_ns);
  const std::uint64_t made_at = now();

  // 4. Every output that was not resident is resident now, at its new block.
  std::string unordered;  // why an output could not be ordered for its stream
  std::size_t unordered_index = 0;
  for (std::size_t k = 0; k < fresh.size(); ++k) {
    buffer_entry* out = fresh[k];
    if (out == nullptr) continue;
    if (out->stream != n.stream) {
      if (std::string why = order_output_locked(*out, n.stream); !why.empty()) {
        // Its stream could read it before the node wrote it: it stays evicted; the block is
        // freed behind the node's work on n.stream.
        by_pointer.erase(output_ptrs[k]);
        allocator.deallocate(output_ptrs[k]);
        if (unordered.empty()) {
          unordered = std::move(why);
          unordered_index = k;
        }
        continue;
      }
    }
    discard_host_copy_locked(*out);  // a spilled output's host copy is no longer needed
    out->device_ptr = output_ptrs[k];
    note_block_locked(*out);
    set_state_locked(*out, buffer_state::resident);
    out->last_access_ns = made_at;
    stats.bytes_recomputed += out->size;
  }
  for (buffer_entry* out : n.outputs) {
    if (out != nullptr) update_candidacy_locked(*out);
  }
  if (!unordered.empty()) {
    throw device_error("spillway: recomputing " + n.desc.name + ": output " +
                       std::to_string(unordered_index) + " cannot be ordered for its stream (" +
                       unordered + "); it stays evicted");
  }
}

// An output made on `made_on` is used on its own stream from now on: that stream waits for the
// node's work. Without an event (the host or the device failing), the node's stream is drained
// instead. Returns the error when even that fails: the output cannot be handed out.
std::string eviction_engine::impl::order_output_locked(buffer_entry& out,
                                                       stream_ref made_on) noexcept {
  try {
    order_after_locked(out.stream, made_on);
    return {};
  } catch (...) {
  }
  try {
    backend.synchronize_stream(made_on);
    return {};
  } catch (const std::exception& e) {
    try {
      return e.what();
    } catch (...) {
      return "?";  // no memory for the message either: empty would mean success
    }
  } catch (...) {
    return "unknown error";  // short: no host memory needed for it
  }
}

}  // namespace spillway::eviction
