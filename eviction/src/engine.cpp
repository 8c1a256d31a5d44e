// engine.cpp: the eviction engine's public API — registration, lineage, pins, forget, queries.
// The state machine is Note [Eviction state machine] in docs/eviction.md.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_set>

#include "engine_impl.hpp"
#include "spillway/sim_device.hpp"
#include "spillway/size_classes.hpp"
#include "spillway/errors.hpp"

namespace spillway::eviction {

using detail::buffer_entry;
using detail::node_entry;

std::string describe_id(buffer_id id) {
  return "buffer " + std::to_string(id.value & 0xffffffffu) + "#" + std::to_string(id.value >> 32);
}

std::uint64_t eviction_engine::impl::steady_now() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

eviction_engine::impl::impl(eviction_engine& s, device_allocator& a, engine_config c)
    : self(s),
      allocator(a),
      backend(a.backend()),
      config(std::move(c)),
      policy(make_policy(config.policy, config.seed)),
      host(a.backend(), config.host_pool_capacity) {
  if (config.max_nested_plans == 0) {
    throw invalid_argument("spillway: engine_config.max_nested_plans is 0; expected >= 1");
  }
  if (config.max_recompute_depth == 0) {
    throw invalid_argument("spillway: engine_config.max_recompute_depth is 0; expected >= 1");
  }
  if (!(config.max_recompute_factor >= 0) || !std::isfinite(config.max_recompute_factor)) {
    throw invalid_argument("spillway: engine_config.max_recompute_factor is " +
                           std::to_string(config.max_recompute_factor) +
                           "; expected a finite number >= 0 (0: no bound)");
  }
  link_bandwidth bw = config.bandwidth;
  if (bw.h2d < 0 || bw.d2h < 0 || std::isnan(bw.h2d) || std::isnan(bw.d2h)) {
    throw invalid_argument("spillway: engine_config.bandwidth is " + std::to_string(bw.h2d) +
                           " B/s host to device, " + std::to_string(bw.d2h) +
                           " B/s device to host; expected positive numbers (0: measured)");
  }
  d2h_stream = backend.create_stream();
  try {
    h2d_stream = backend.create_stream();
    if (bw.h2d == 0 || bw.d2h == 0) {
      // A direction not given: the simulated device's model, or a real link measured. One given
      // is kept.
      link_bandwidth found;
      if (const auto* sim = dynamic_cast<const sim_device*>(&backend)) {
        found = {sim->config().h2d_bandwidth, sim->config().d2h_bandwidth};
      } else {
        found = measure_bandwidth(a, d2h_stream);  // within the budget: see cost_model.hpp
      }
      if (bw.h2d == 0) bw.h2d = found.h2d;
      if (bw.d2h == 0) bw.d2h = found.d2h;
    }
    costs = std::make_unique<cost_model>(bw);  // invalid_argument for an infinite bandwidth
  } catch (...) {
    destroy_copy_streams();  // the engine is not made: its destructor will not run
    throw;
  }
}

void eviction_engine::impl::destroy_copy_streams() noexcept {
  if (d2h_stream.value != 0) backend.destroy_stream(d2h_stream);
  if (h2d_stream.value != 0) backend.destroy_stream(h2d_stream);
  d2h_stream = h2d_stream = stream_ref{};
}

namespace {
// The allocators that have an engine. One per allocator: each engine calls the allocator (and so
// every pressure handler of it) with its own lock held, and its handler waits for that lock, so two
// engines evicting for each other's allocations on two threads would wait for each other forever.
std::mutex engines_mutex;
std::unordered_set<const device_allocator*>& allocators_with_engine() {
  static auto* set = new std::unordered_set<const device_allocator*>();  // outlives every engine
  return *set;
}
}  // namespace

eviction_engine::eviction_engine(device_allocator& allocator, engine_config config) {
  {
    std::lock_guard lock(engines_mutex);
    if (!allocators_with_engine().insert(&allocator).second) {
      throw invalid_argument("spillway: the device_allocator of device " +
                             std::to_string(allocator.device()) +
                             " has an eviction_engine already; expected one engine per allocator "
                             "(two would wait for each other's lock in each other's pressure handler)");
    }
  }
  try {
    impl_ = std::make_unique<impl>(*this, allocator, std::move(config));
    impl_->gate->engine = impl_.get();
    impl_->handler_id = allocator.add_pressure_handler(
        [g = impl_->gate](const pressure_request& r) { return g->call(r); });
  } catch (...) {
    if (impl_) impl_->destroy_copy_streams();  // made, then the handler could not be added
    std::lock_guard lock(engines_mutex);
    allocators_with_engine().erase(&allocator);
    throw;
  }
}

eviction_engine::~eviction_engine() {
  impl& m = *impl_;
  m.allocator.remove_pressure_handler(m.handler_id);
  m.gate->close();  // a call from the allocator's snapshot may still come: it finds the gate closed
  engine_lock lock(m);
  m.abort_if_pinned_locked();
  try {
    m.backend.synchronize_stream(m.d2h_stream);
    m.backend.synchronize_stream(m.h2d_stream);
  } catch (const std::exception&) {
    // A held simulated stream: the host pool still waits on each event before reusing memory.
  }
  try {
    m.reap_in_flight_locked();
  } catch (...) {
    // An event query failed: what is still in flight is freed below all the same.
  }
  m.buffers.for_each([&](buffer_entry& e) {
    if (m.candidates.contains(e)) m.candidates.erase(e);
    if (e.device_ptr != nullptr) m.allocator.deallocate(e.device_ptr);  // behind its streams
    if (e.ready.value != 0) m.backend.destroy_event(e.ready);  // a restore not reaped above
    m.discard_host_copy_locked(e);
  });
  for (const impl::detached_copy& c : m.detached_d2h) m.backend.destroy_event(c.done);
  for (event_ref e : m.idle_events) m.backend.destroy_event(e);
  m.destroy_copy_streams();
  std::lock_guard registry(engines_mutex);
  allocators_with_engine().erase(&m.allocator);
}

// A pinned_buffer guard or a released pin still outstanding would call into the engine once it is
// gone (and its buffer's block would be freed under the caller's pointer): a misuse no later call
// can survive, so it is reported, naming what is pinned, and the process stops.
void eviction_engine::impl::abort_if_pinned_locked() noexcept {
  std::size_t pinned = 0, bytes = 0;
  std::uint64_t first = 0;
  buffers.for_each([&](buffer_entry& e) {
    if (e.pins == 0) return;
    if (pinned++ == 0) first = e.id.value;
    bytes += e.size;
  });
  if (pinned == 0) return;
  std::fprintf(stderr,
               "spillway: eviction_engine destroyed while %zu buffer(s) of %zu bytes are pinned "
               "(buffer %llu first): reset or destroy every pinned_buffer guard, and give every "
               "released pin back with unpin(), before the engine; aborting, as they would call "
               "into it afterwards\n",
               pinned, bytes, static_cast<unsigned long long>(first));
  std::abort();
}

// --- lookups ---------------------------------------------------------------------------------------

buffer_entry& eviction_engine::impl::lookup_locked(buffer_id id, const char* operation) const {
  buffer_entry* e = buffers.find(id.value);
  if (e != nullptr && e->user_owned) return *e;
  const bool forgotten = e != nullptr || buffers.stale(id.value);
  throw invalid_argument(std::string("spillway: ") + operation + "(" + describe_id(id) + "): " +
                         (forgotten ? "the buffer was forgotten" : "no such buffer"));
}

node_entry& eviction_engine::impl::lookup_node_locked(node_id id, const char* operation) const {
  node_entry* n = nodes.find(id.value);
  if (n != nullptr && n->alive && !n->removed) return *n;
  throw invalid_argument(std::string("spillway: ") + operation + ": lineage node " +
                         std::to_string(id.value & 0xffffffffu) +
                         (n != nullptr && n->removed ? " was removed (remove_node)"
                          : nodes.stale(id.value)
                              ? " no longer exists (all its outputs were forgotten, or it was removed)"
                              : " does not exist"));
}

// --- lineage ---------------------------------------------------------------------------------------

node_id eviction_engine::add_node(lineage_node desc) {
  impl& m = *impl_;
  if (!desc.compute) {
    throw invalid_argument("spillway: add_node(" + desc.name + "): compute is empty");
  }
  if (desc.output_count == 0) {
    throw invalid_argument("spillway: add_node(" + desc.name + "): output_count is 0; expected >= 1");
  }
  if (!(desc.cost_ns >= 0) || !std::isfinite(desc.cost_ns)) {
    throw invalid_argument("spillway: add_node(" + desc.name + "): cost_ns " +
                           std::to_string(desc.cost_ns) + " is not a finite number >= 0");
  }
  engine_lock lock(m);
  std::vector<buffer_entry*> inputs;
  inputs.reserve(desc.inputs.size());
  for (buffer_id in : desc.inputs) inputs.push_back(&m.lookup_locked(in, "add_node input"));
  for (buffer_entry* in : inputs) {  // room for the push below; geometric, or it turns quadratic
    if (in->consumers.size() == in->consumers.capacity()) {
      in->consumers.reserve(std::max<std::size_t>(4, 2 * in->consumers.size()));
    }
  }
  std::uint64_t id = 0;
  node_entry* n = m.nodes.make(id);
  n->id = id;
  n->alive = true;
  n->cost_holder = nullptr;
  n->outputs.assign(desc.output_count, nullptr);
  n->output_sizes.assign(desc.output_count, 0);
  n->desc = std::move(desc);
  n->inputs = std::move(inputs);
  m.lineage_cost_ns += n->desc.cost_ns;
  ++m.lineage_nodes;
  for (buffer_entry* in : n->inputs) in->consumers.push_back(n);  // reserved below, cannot throw
  return node_id{id};
}

void eviction_engine::remove_node(node_id id) {
  impl& m = *impl_;
  engine_lock lock(m);
  node_entry& n = m.lookup_node_locked(id, "remove_node");
  n.removed = true;
  if (n.live_outputs == 0) m.retire_node_locked(n);  // else detach_output_locked retires it
}

void eviction_engine::impl::attach_output_locked(buffer_entry& e, node_entry& n, std::uint32_t index) {
  if (index >= n.outputs.size()) {
    throw invalid_argument("spillway: output_index " + std::to_string(index) + " of node '" +
                           n.desc.name + "' is out of range; it has " +
                           std::to_string(n.outputs.size()) + " output(s)");
  }
  if (n.outputs[index] != nullptr && n.outputs[index] != &e) {
    throw invalid_argument("spillway: output " + std::to_string(index) + " of node '" + n.desc.name +
                           "' is already " + describe_id(n.outputs[index]->id));
  }
  if (n.output_sizes[index] != 0 && n.output_sizes[index] != e.size) {
    throw invalid_argument("spillway: output " + std::to_string(index) + " of node '" + n.desc.name +
                           "' has " + std::to_string(n.output_sizes[index]) + " bytes, not " +
                           std::to_string(e.size));
  }
  if (n.live_outputs == 0 && n.outputs[index] == nullptr) n.stream = e.stream;
  if (n.outputs[index] == nullptr) ++n.live_outputs;
  n.outputs[index] = &e;
  n.output_sizes[index] = e.size;
  e.producer = &n;
  e.output_index = index;
}

void eviction_engine::impl::detach_output_locked(buffer_entry& e) noexcept {
  node_entry* n = e.producer;
  if (n == nullptr) return;
  e.producer = nullptr;
  n->outputs[e.output_index] = nullptr;
  if (--n->live_outputs == 0) retire_node_locked(*n);
}

// A node with no output left can never be asked to recompute: it lets go of its inputs.
void eviction_engine::impl::retire_node_locked(node_entry& n) noexcept {
  std::vector<buffer_entry*> inputs = std::move(n.inputs);
  lineage_cost_ns = std::max(0.0, lineage_cost_ns - n.desc.cost_ns);
  --lineage_nodes;
  nodes.recycle(n.id);
  for (buffer_entry* in : inputs) {
    // Swap-and-pop: order does not matter, and the most recent reader is usually at the back.
    auto& readers = in->consumers;
    for (std::size_t i = readers.size(); i-- > 0;) {
      if (readers[i] == &n) {
        readers[i] = readers.back();
        readers.pop_back();
        break;
      }
    }
    if (in->consumers.empty() && !in->user_owned) release_entry_locked(*in);  // queued, if releasing
  }
}

void eviction_engine::set_lineage(buffer_id id, node_id producer, std::uint32_t output_index) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "set_lineage");
  node_entry& n = m.lookup_node_locked(producer, "set_lineage");
  if (e.producer == &n && e.output_index == output_index) return;
  // A node that reads its own output (an in-place update recorded as x = f(x)) could never
  // recompute it, and the two would keep each other alive after forget.
  if (std::find(n.inputs.begin(), n.inputs.end(), &e) != n.inputs.end()) {
    throw invalid_argument("spillway: set_lineage(" + describe_id(id) + ", node '" + n.desc.name +
                           "'): the node reads " + describe_id(id) +
                           " itself; expected a node that does not read its output (record an "
                           "in-place update as a new buffer)");
  }
  node_entry* old = e.producer;
  const std::uint32_t old_index = e.output_index;
  m.graph_remove_locked(e);  // its edges change: out of the graph meanwhile
  try {
    m.attach_output_locked(e, n, output_index);  // validates first; throws before any change
  } catch (...) {
    m.graph_insert_locked(e);
    throw;
  }
  if (old != nullptr) {
    old->outputs[old_index] = nullptr;
    if (--old->live_outputs == 0) m.retire_node_locked(*old);
  }
  m.graph_insert_locked(e);
  if (m.candidates.contains(e)) {  // a new cost: the record, and its place in the cost order
    detail::candidate_record& r = m.candidates.record(e);
    r = m.make_record_locked(e);
    m.candidates.reorder(e, m.cost_per_byte_locked(r));
  }
}

// --- registration ------------------------------------------------------------------------------------

buffer_id eviction_engine::register_buffer(void* ptr, std::size_t size, stream_ref stream,
                                           buffer_options options) {
  impl& m = *impl_;
  engine_lock lock(m);
  if (!m.allocator.owns(ptr)) {
    throw invalid_argument("spillway: register_buffer(" + format_pointer(ptr) +
                           "): not a live allocation of device " +
                           std::to_string(m.allocator.device()) + "'s allocator");
  }
  const allocation_info info = m.allocator.describe(ptr);
  if (size == 0 || size > info.size) {
    throw invalid_argument("spillway: register_buffer(" + format_pointer(ptr) + ", " +
                           std::to_string(size) + " bytes): expected 1.." +
                           std::to_string(info.size) + " bytes (the allocation's size)");
  }
  if (m.by_pointer.count(ptr) != 0) {
    throw invalid_argument("spillway: register_buffer(" + format_pointer(ptr) + "): already " +
                           describe_id(m.by_pointer[ptr]->id));
  }
  node_entry* producer =
      options.producer.valid() ? &m.lookup_node_locked(options.producer, "register_buffer") : nullptr;
  m.check_stream_locked(stream, ptr);

  // First, as it may throw: a key left unused by a registration that fails later is harmless.
  const detail::access_profile::step_key key =
      m.config.predict_next_use ? m.access.on_register(size) : detail::access_profile::step_key{};
  std::uint64_t id = 0;
  buffer_entry* e = m.buffers.make(id);
  e->id = buffer_id{id};
  e->access_key = key;
  e->device_ptr = ptr;
  e->size = size;
  e->stream = stream;
  impl::note_block(*e, info);
  e->evictable = options.evictable;
  e->mode = options.mode;
  e->last_access_ns = m.now();
  try {
    m.candidates.reserve_total(m.buffers.slots());  // a slot for every buffer record
    if (producer != nullptr) m.attach_output_locked(*e, *producer, options.output_index);
    // Used on another stream than the one it was allocated on: its free waits for that stream.
    if (info.stream != stream) m.allocator.record_stream(ptr, stream);
    m.by_pointer.emplace(ptr, e);
    m.graph_insert_locked(*e);  // next to the dropped classes of its inputs, if any
    m.update_candidacy_locked(*e);
  } catch (...) {
    m.graph_remove_locked(*e);
    m.by_pointer.erase(ptr);
    if (e->producer != nullptr) {
      e->producer->outputs[e->output_index] = nullptr;
      --e->producer->live_outputs;
    }
    m.buffers.recycle(id);
    throw;
  }
  ++m.stats.registered;
  return e->id;
}

void eviction_engine::forget(buffer_id id) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "forget");
  if (e.pins > 0) {
    throw invalid_argument("spillway: forget(" + describe_id(id) + "): it is pinned (" +
                           std::to_string(e.pins) + " pin(s)); unpin it first");
  }
  e.user_owned = false;
  --m.stats.registered;
  if (e.consumers.empty()) m.release_entry_locked(e);
  // else: a live node needs it as an input; it stays, hidden and evictable, until then.
}

// A stream the device does not know would fail every later spill and restore of the buffer, and
// the free of its block could not be ordered (the allocator leaks it): refused now, as pin(id, use)
// refuses one. Each stream is checked once, by recording an event on it.
void eviction_engine::impl::check_stream_locked(stream_ref s, void* ptr) {
  if (s.value == 0 || std::find(known_streams.begin(), known_streams.end(), s) != known_streams.end()) {
    return;
  }
  const event_ref probe = take_event_locked();
  try {
    backend.record_event(probe, s);
  } catch (const invalid_argument& error) {
    give_event_locked(probe);
    throw invalid_argument("spillway: register_buffer(" + format_pointer(ptr) + ", stream " +
                           std::to_string(s.value) + "): expected a stream of device " +
                           std::to_string(allocator.device()) + " (" + error.what() + ")");
  } catch (...) {
    give_event_locked(probe);
    throw;
  }
  give_event_locked(probe);
  if (known_streams.size() >= 64) known_streams.clear();  // many streams: checked again, stays small
  known_streams.push_back(s);
}

// Frees everything the entry holds and recycles it, then what only it kept alive: a node that
// loses its last output retires and lets go of its inputs, and a forgotten input no live node
// needs any more is released in turn. The cascade is a loop over release_stack, so that a long
// forgotten chain costs no stack (Note [Eviction state machine]); a call made while one drains
// (from retire_node_locked) only queues the entry.
void eviction_engine::impl::release_entry_locked(buffer_entry& e) noexcept {
  e.release_next = release_stack;
  release_stack = &e;
  if (releasing) return;
  releasing = true;
  while (release_stack != nullptr) {
    buffer_entry& next = *release_stack;
    release_stack = next.release_next;
    free_entry_locked(next);  // may queue the inputs its node lets go of
  }
  releasing = false;
}

void eviction_engine::impl::free_entry_locked(buffer_entry& e) noexcept {
  graph_remove_locked(e);
  if (candidates.contains(e)) candidates.erase(e);
  if (e.device_ptr != nullptr) {
    by_pointer.erase(e.device_ptr);
    allocator.deallocate(e.device_ptr);
    e.device_ptr = nullptr;
  }
  discard_host_copy_locked(e);
  for (auto it = in_flight.begin(); it != in_flight.end(); ++it) {
    if (*it == &e) {
      in_flight.erase(it);
      break;
    }
  }
  if (e.ready.value != 0) give_event_locked(e.ready);
  const std::uint64_t id = e.id.value;
  detach_output_locked(e);
  buffers.recycle(id);
}

// --- pins ----------------------------------------------------------------------------------------------

pinned_buffer eviction_engine::pin(buffer_id id) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "pin");
  buffer_entry* const read[] = {&e};
  m.note_access_locked(read);
  m.make_resident_locked(e, 0);
  m.pin_locked(e);
  return pinned_buffer(this, id, e.device_ptr, e.size);
}

pinned_buffer eviction_engine::pin(buffer_id id, stream_ref use) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "pin");
  buffer_entry* const read[] = {&e};
  m.note_access_locked(read);
  m.make_resident_locked(e, 0);
  m.pin_locked(e);
  try {
    m.use_on_stream_locked(e, use);
  } catch (...) {
    m.unpin_locked(e);
    throw;
  }
  return pinned_buffer(this, id, e.device_ptr, e.size);
}

// A caller's pin or pin_all is one access event of the step under way (Note [Next-use
// prediction]); the engine's own pins, while it recomputes, are not. It also starts the count of
// what the call recomputes (Note [Thrashing bound]).
void eviction_engine::impl::note_access_locked(std::span<buffer_entry* const> entries) {
  call_recompute_ns = 0;
  call_recomputes = 0;
  if (access.steps() == 0) return;
  access.begin_event(now());
  for (const buffer_entry* e : entries) access.on_read(e->access_key);
}

void eviction_engine::begin_step() {
  impl& m = *impl_;
  engine_lock lock(m);
  if (!m.config.predict_next_use) return;
  m.access.begin_step(m.now());
  ++m.stats.steps;
  // The candidates' next reads were in the last step's record; a buffer carried over from it has
  // no key in the new one.
  for (std::size_t i = 0; i < m.candidates.size(); ++i) {
    detail::candidate_record& r = m.candidates.at(i);
    r.next_read = r.entry->next_read = detail::access_profile::no_event;
  }
  m.forget_class_next_reads_locked();  // so are those of the dropped buffers
}

void eviction_engine::unpin(buffer_id id) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "unpin");
  if (e.pins == 0) {
    throw invalid_argument("spillway: unpin(" + describe_id(id) + "): it is not pinned");
  }
  if (e.released_pins == 0) {
    throw invalid_argument("spillway: unpin(" + describe_id(id) + "): its " + std::to_string(e.pins) +
                           " pin(s) belong to pinned_buffer guards or to a recompute under way, not to "
                           "the caller; a guard unpins when reset or destroyed (release() it first to "
                           "unpin by hand)");
  }
  --e.released_pins;
  m.unpin_locked(e);
}

void eviction_engine::impl::pin_locked(buffer_entry& e) {
  hold_locked(e);
  e.last_access_ns = now();
}

void eviction_engine::impl::hold_locked(buffer_entry& e) noexcept {
  if (e.pins++ == 0) {
    stats.pinned_bytes += e.size;
    if (candidates.contains(e)) candidates.erase(e);
  }
}

void eviction_engine::impl::release_hold_locked(buffer_entry& e) noexcept {
  if (--e.pins > 0) return;
  stats.pinned_bytes -= e.size;
  try {
    update_candidacy_locked(e);
  } catch (...) {
    // Out of memory for the candidate vector: the buffer simply stays resident.
  }
}

void eviction_engine::impl::unpin_locked(buffer_entry& e) noexcept {
  if (e.pins == 1) e.last_access_ns = now();  // its last pin: a use, up to now
  release_hold_locked(e);
}

// e has a new block (restored, recomputed or moved): which segment holds it, whether the block is
// all of it (then evicting e gives the segment back; dtr-frag looks for such victims), and its
// pool, by the block's size as at registration (a buffer smaller than its first block may land
// in the other pool).
void eviction_engine::impl::note_block(buffer_entry& e, const allocation_info& info) noexcept {
  e.small_pool = info.size <= size_classes::small_size;
  e.block_stream = info.stream;
  e.segment_size = info.segment_size;
  e.whole_segment = info.size == info.segment_size;
}

void eviction_engine::impl::note_block_locked(buffer_entry& e) noexcept {
  try {
    note_block(e, allocator.describe(e.device_ptr));
  } catch (...) {  // cannot happen: the block is live
    e.block_stream = e.stream;
    e.segment_size = 0;
    e.whole_segment = false;
  }
}

// A candidate is resident, unpinned and evictable (Note [Eviction state machine]).
void eviction_engine::impl::update_candidacy_locked(buffer_entry& e) {
  const bool should = e.state == buffer_state::resident && e.pins == 0 && e.evictable;
  if (should && !candidates.contains(e)) {
    const detail::candidate_record r = make_record_locked(e);
    candidates.insert(e, r, cost_per_byte_locked(r));
  }
  if (!should && candidates.contains(e)) candidates.erase(e);
}

// What a policy sees of e, read once when it becomes a candidate. Nothing in it changes while it
// is one, except the neighbourhood cost and the next read, which set_neighbourhood_locked keeps
// current as the classes next to it change.
detail::candidate_record eviction_engine::impl::make_record_locked(buffer_entry& e) const noexcept {
  detail::candidate_record r;
  r.entry = &e;
  r.id = e.id;
  r.size = e.size;
  r.last_access_ns = e.last_access_ns;
  r.recompute_ns = static_cast<float>(e.producer != nullptr ? e.producer->desc.cost_ns : 0);
  r.neighbourhood_ns = static_cast<float>(charged_neighbourhood_locked(e));
  r.stream = e.block_stream;  // the pool its eviction frees a range in
  r.segment_size = e.segment_size;
  r.whole_segment = e.whole_segment;
  e.next_read = access.next_read(e.access_key, e.size);
  r.next_read = needed_next_locked(e);
  r.mode = e.mode;
  r.small_pool = e.small_pool;
  r.can_drop = can_drop_locked(e);
  r.can_spill = config.allow_spill && e.mode != eviction_mode::drop;
  return r;
}

// --- other operations and queries ---------------------------------------------------------------------

bool eviction_engine::prefetch(buffer_id id) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "prefetch");
  m.reap_in_flight_locked();
  if (e.state != buffer_state::spilled && e.state != buffer_state::spilling) return true;
  try {
    m.restore_locked(e);  // leaves e spilled (or spilling) when its block cannot be allocated
  } catch (const out_of_memory&) {
    return false;  // a hint that cannot be served now; the pin that needs it will try again
  }
  return true;
}

bool eviction_engine::evict(buffer_id id, eviction_mode mode) {
  impl& m = *impl_;
  engine_lock lock(m);
  buffer_entry& e = m.lookup_locked(id, "evict");
  if (e.pins > 0) {
    throw invalid_argument("spillway: evict(" + describe_id(id) + "): it is pinned");
  }
  m.reap_in_flight_locked();
  if (e.state != buffer_state::resident) return e.state != buffer_state::restoring;
  if (!e.evictable) return false;  // registered as never evicted (buffer_options::evictable)
  return m.evict_locked(e, mode);
}

buffer_state eviction_engine::state(buffer_id id) const {
  impl& m = *impl_;
  engine_lock lock(m);
  m.reap_in_flight_locked();
  return m.lookup_locked(id, "state").state;
}

std::optional<candidate_info> eviction_engine::describe_candidate(buffer_id id) const {
  impl& m = *impl_;
  engine_lock lock(m);
  const buffer_entry& e = m.lookup_locked(id, "describe_candidate");
  if (!m.candidates.contains(e)) return std::nullopt;
  m.host_room = m.host.room();
  return m.describe_candidate_locked(m.candidates.record(e), m.now());
}

std::vector<buffer_id> eviction_engine::cheapest_to_drop(std::size_t k) const {
  impl& m = *impl_;
  engine_lock lock(m);
  std::array<std::size_t, detail::candidate_set::max_cheapest> indices{};
  const std::size_t n = m.candidates.cheapest_per_byte(std::span(indices).first(std::min(k, indices.size())));
  std::vector<buffer_id> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) out.push_back(m.candidates.at(indices[i]).id);
  return out;
}

std::size_t eviction_engine::size(buffer_id id) const {
  impl& m = *impl_;
  engine_lock lock(m);
  return m.lookup_locked(id, "size").size;
}

engine_stats eviction_engine::stats() const {
  impl& m = *impl_;
  engine_lock lock(m);
  engine_stats s = m.stats;
  s.next_use_mismatches = m.access.mismatches();
  s.resident_bytes = 0;
  m.buffers.for_each([&](const buffer_entry& e) {
    if (e.device_ptr != nullptr) s.resident_bytes += e.size;
  });
  return s;
}

const cost_model& eviction_engine::costs() const noexcept { return *impl_->costs; }
device_allocator& eviction_engine::allocator() const noexcept { return impl_->allocator; }

// --- pinned_buffer --------------------------------------------------------------------------------------

pinned_buffer::pinned_buffer(pinned_buffer&& o) noexcept
    : engine_(o.engine_), id_(o.id_), ptr_(o.ptr_), size_(o.size_) {
  o.engine_ = nullptr;
}

pinned_buffer& pinned_buffer::operator=(pinned_buffer&& o) noexcept {
  if (this != &o) {
    reset();
    engine_ = o.engine_;
    id_ = o.id_;
    ptr_ = o.ptr_;
    size_ = o.size_;
    o.engine_ = nullptr;
  }
  return *this;
}

pinned_buffer::~pinned_buffer() { reset(); }

void pinned_buffer::reset() noexcept {
  if (engine_ == nullptr) return;
  eviction_engine::impl& m = *engine_->impl_;
  engine_lock lock(m);
  // The guard's pin is its own (unpin refuses it), so the entry is there and pinned; the checks
  // only keep a destructor from touching what it cannot own.
  if (detail::buffer_entry* e = m.buffers.find(id_.value); e != nullptr && e->pins > e->released_pins) {
    m.unpin_locked(*e);
  }
  engine_ = nullptr;
  ptr_ = nullptr;
}

buffer_id pinned_buffer::release() noexcept {
  if (engine_ == nullptr) return buffer_id{};
  eviction_engine::impl& m = *engine_->impl_;
  engine_lock lock(m);
  if (detail::buffer_entry* e = m.buffers.find(id_.value); e != nullptr && e->pins > e->released_pins) {
    ++e->released_pins;
  }
  const buffer_id id = id_;
  engine_ = nullptr;
  ptr_ = nullptr;
  return id;
}

}  // namespace spillway::eviction
