// engine: evicts registered buffers under the allocator's memory pressure, and gives each one
// back bit-identical before it is used.
//
// Contract
// - An engine serves one device_allocator and registers itself as its pressure handler for its
//   lifetime. An allocation over budget makes the engine evict (spill or drop, per buffer, by the
//   cost model) until the allocator can serve it; see Note [Memory pressure path]. One engine
//   per allocator (a second is invalid_argument): the engine allocates with its lock held, which
//   runs the allocator's other pressure handlers and its on_warning on that thread under the
//   lock, so those must not wait for a lock that a thread holds while it calls the engine.
// - register_buffer(ptr, ...) takes ownership of a live allocation of that allocator: from then on
//   the engine frees it (on eviction or forget) and may move it. The only way to its bytes is pin(),
//   which makes it resident (restoring or recomputing it) and returns the pointer, valid in stream
//   order on the buffer's stream (or the stream given to pin) while the pin lives.
// - Pinned buffers are never evicted nor moved. Unpinned resident buffers may be evicted, or moved
//   to another block of the allocator to empty a segment (Note [Compaction]), at any allocation,
//   including one made to bring back another buffer: pin_all pins an operation's inputs together.
// - Spill: the device block returns to the allocator only after its device-to-host copy completed,
//   in stream order, with no device synchronisation; a restore waits on the spill's event.
//   If no pinned host memory is available the engine drops (where lineage exists) or picks
//   another victim; it never loses data.
// - Recompute is recursive: dropped inputs are rematerialised first and stay pinned while the node
//   runs (planned first, then run node after node: no stack per level). Cycles and lineage deeper
//   than max_recompute_depth fail with std::logic_error naming the nodes, before anything changes.
//   A pin whose recomputes pass max_recompute_factor times the lineage's whole cost (or number of
//   nodes) is thrashing (what it rebuilds is evicted again to make room for the rest): it fails
//   with out_of_memory, every buffer consistent and whole, as when an allocation fails; so does
//   one whose plans nest (an input evicted again before its node ran) past max_nested_plans.
// - Work queued on the stream given to pin(id, use) is ordered with the buffer's own: its block is
//   not freed or reused, nor spilled, before that work has run.
// - Errors: misuse (unknown or forgotten id, unpin without pin, forget while pinned, registering a
//   pointer the allocator does not own) is spillway::invalid_argument naming the id or pointer;
//   out_of_memory passes through from the allocator, naming the pinned bytes.
// - Thread-safe: one engine mutex, taken before the allocator's (never the other way round).
//   Pressure callbacks that arrive on the thread that already holds the engine lock (an allocation
//   the engine itself makes) run under that lock. See Note [Eviction lock order].
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "spillway/device_allocator.hpp"
#include "spillway/eviction/buffer.hpp"
#include "spillway/eviction/cost_model.hpp"
#include "spillway/eviction/lineage.hpp"
#include "spillway/eviction/policy.hpp"

namespace spillway::eviction {

struct engine_config {
  std::string policy = "dtr-frag";             // make_policy name
  std::uint64_t seed = 1;
  std::size_t host_pool_capacity = std::size_t{64} << 30;  // pinned host bytes for spills
  // Bytes/s each way. A direction left at zero: the simulated device's model, or on a real device
  // measured at construction with a probe allocated within the budget (measure_bandwidth;
  // out_of_memory when the budget leaves no room); one given is kept. Negative, NaN or infinite:
  // invalid_argument.
  link_bandwidth bandwidth{};
  std::size_t max_recompute_depth = 10000;     // lineage depth before runaway recursion is declared
  // Thrashing: one pin or pin_all may recompute nodes costing at most this many times the cost of
  // every live lineage node once, and run at most this many times their number; past either, it
  // fails with out_of_memory instead of going on (Note [Thrashing bound]). 0: no bound. Must be
  // finite and >= 0.
  double max_recompute_factor = 8;
  // Recompute plans nested in one another: a plan's node finds an input evicted since the plan
  // began (its hold let go to fit, Note [Recompute plans hold their outputs]) and brings it back
  // with a plan of its own, on the stack (about 1.2 KiB a level in a release build, several
  // times that with sanitizers). Past this many levels the pin is thrashing and fails with
  // out_of_memory, as past max_recompute_factor, long before the stack could run out. Must be >= 1.
  std::size_t max_nested_plans = 256;
  bool allow_spill = true;
  bool allow_drop = true;
  // Under a budget with fixed segments, empty segments by moving unpinned resident buffers into
  // holes of other segments (a device-to-device copy) before evicting any (Note [Compaction]).
  bool compact = true;
  // Time for staleness (DTR) in ns. Default: steady_clock. The simulator passes the sim clock.
  // Called under the engine lock; one that throws is read as the last time it gave.
  std::function<std::uint64_t()> clock;
  // With steps marked (begin_step): record each step's reads and predict every candidate's next
  // use from the last step's (Note [Next-use prediction]). False: begin_step does nothing.
  bool predict_next_use = true;
};

struct engine_stats {
  std::uint64_t registered = 0;        // buffers currently registered
  std::uint64_t resident_bytes = 0;
  std::uint64_t pinned_bytes = 0;
  std::uint64_t evictions = 0;
  std::uint64_t spills = 0;
  std::uint64_t drops = 0;
  std::uint64_t restores = 0;          // copies back from host
  std::uint64_t recomputes = 0;        // lineage node executions
  std::uint64_t plan_holds_released = 0;  // recompute plans that let their held outputs go to fit
  std::uint64_t pin_holds_released = 0;   // pins of several buffers that let their first pins go to fit
  std::uint64_t bytes_spilled = 0;
  std::uint64_t bytes_restored = 0;
  std::uint64_t bytes_recomputed = 0;
  double recompute_cost_ns = 0;        // sum of the cost of node executions
  // Compaction (Note [Compaction]): buffers moved to another block, their bytes, segments emptied.
  std::uint64_t moves = 0;
  std::uint64_t bytes_moved = 0;
  std::uint64_t segments_emptied = 0;
  std::uint64_t host_allocation_failures = 0;
  std::uint64_t pressure_calls = 0;
  std::uint64_t decisions = 0;         // policy choose() calls
  double decision_time_ns = 0;         // total wall time spent in choose(), the view's work included
  // Keeping the candidates' cached neighbourhood costs current (Note [Eviction policies]): the
  // steps taken at drops, recomputes and when a dropped buffer is forgotten, and their wall time.
  std::uint64_t upkeep_steps = 0;
  double upkeep_time_ns = 0;
  // Next-use prediction: steps begun, and reads of a step's buffers that the last step's record
  // did not show at that point (the program diverged; predictions were off for them).
  std::uint64_t steps = 0;
  std::uint64_t next_use_mismatches = 0;
};

class eviction_engine;

// A pin: the buffer stays resident, at get(), until the guard is destroyed or reset, or, after
// release(), until eviction_engine::unpin(id). unpin() gives back only released pins: a pin that
// a guard still holds is the guard's, so an unpin that would leave a guard pointing at a buffer
// the engine may evict or move is refused.
class pinned_buffer {
 public:
  pinned_buffer() = default;
  pinned_buffer(pinned_buffer&& other) noexcept;
  pinned_buffer& operator=(pinned_buffer&& other) noexcept;
  ~pinned_buffer();

  void* get() const noexcept { return ptr_; }
  template <class T>
  T* as() const noexcept { return static_cast<T*>(ptr_); }
  buffer_id id() const noexcept { return id_; }
  std::size_t size() const noexcept { return size_; }
  explicit operator bool() const noexcept { return engine_ != nullptr; }
  void reset() noexcept;
  // Lets the pin outlive the guard: the buffer stays pinned, the guard becomes empty, and the
  // caller gives the pin back with eviction_engine::unpin(id). Returns the id; on an empty guard,
  // buffer_id{} and nothing happens.
  buffer_id release() noexcept;

 private:
  friend class eviction_engine;
  pinned_buffer(eviction_engine* e, buffer_id id, void* ptr, std::size_t size) noexcept
      : engine_(e), id_(id), ptr_(ptr), size_(size) {}
  eviction_engine* engine_ = nullptr;
  buffer_id id_;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
};

class eviction_engine {
 public:
  eviction_engine(device_allocator& allocator, engine_config config = {});
  // Unregisters from the allocator, waits for its pressure handler calls under way on other
  // threads (a call that starts later frees nothing), and frees every buffer it owns. Not from
  // inside a pressure handler or a lineage compute. Every pinned_buffer guard must be gone, and
  // every released pin given back, first: with a pin outstanding (which would call into the
  // engine afterwards, and whose block would be freed under its pointer) it writes what is
  // pinned to stderr and aborts.
  ~eviction_engine();
  eviction_engine(const eviction_engine&) = delete;
  eviction_engine& operator=(const eviction_engine&) = delete;

  // Lineage: a node whose outputs are registered afterwards with buffer_options::producer.
  node_id add_node(lineage_node node);
  // Says that no more outputs of the node will be registered (its op was skipped, or its outputs
  // were never kept): with none registered, it is released at once and lets go of its inputs
  // (forgotten inputs it alone needed are freed); otherwise it is released with its last output.
  // Either way, naming it afterwards (register_buffer, set_lineage, remove_node) is an error.
  void remove_node(node_id id);

  // Takes ownership of `ptr`, a live allocation of the allocator of `size` bytes used on `stream`.
  // A stream is checked when the engine first sees it: one the device does not know (never
  // created, or destroyed already) is invalid_argument naming the pointer and the stream, as for
  // pin(id, use).
  buffer_id register_buffer(void* ptr, std::size_t size, stream_ref stream,
                            buffer_options options = {});
  // Gives an existing buffer new lineage: it is now output `output_index` of `producer` (for
  // example after an in-place update). A producer that reads the buffer itself (an in-place update
  // recorded as x = f(x)) is invalid_argument naming both: it could never recompute it. Lineage
  // may still form a longer cycle, which rematerialisation detects and reports.
  void set_lineage(buffer_id id, node_id producer, std::uint32_t output_index = 0);

  // Releases the buffer (its memory, host copy and, once no output of it is left, its node).
  // A forgotten buffer that a live node still needs as an input is kept, hidden, until then.
  void forget(buffer_id id);

  // Marks the start of a training step, a sequence of operations that repeats. From then on each
  // pin or pin_all call is one access event of the step: the engine records which of the buffers
  // registered in the step it reads, and from the second step on predicts, for every candidate,
  // how soon it is read again, from the last step's record. DTR's policies weigh victims by that
  // instead of by staleness (time since last use), where there is a prediction (a buffer of the
  // step, of its recorded size, read at the same point of the step as before). A hint only: a
  // step that differs costs better choices, never data. Note [Next-use prediction].
  void begin_step();

  pinned_buffer pin(buffer_id id);                  // usable on the buffer's own stream
  pinned_buffer pin(buffer_id id, stream_ref use);  // also ordered for `use`
  // Pins the inputs of one operation together, as DTR locks an operator's arguments: the buffers
  // that are resident are pinned first, so bringing back the others (whose recompute may need
  // evictions) never evicts them; then the others are made resident one by one. If one of those
  // does not fit, the call lets its own pins go and tries once more with that one first (the
  // others may then be evicted and brought back after it; Note [Pinning together lets go to
  // fit]). Returns the pins in the order of `ids` (an id may repeat). On failure no pin taken by
  // the call is left.
  std::vector<pinned_buffer> pin_all(std::span<const buffer_id> ids);
  // Gives back a pin taken over from its guard with pinned_buffer::release(). Refused
  // (invalid_argument naming the id) when the buffer has no released pin: not pinned at all, or
  // pinned only by guards, which unpin themselves.
  void unpin(buffer_id id);

  // Starts restoring a spilled buffer and returns at once. A hint: when no memory can be had for
  // it now, it returns false and the buffer stays spilled (the pressure path may have evicted
  // others trying). True when a restore is under way or nothing needed restoring.
  bool prefetch(buffer_id id);
  bool evict(buffer_id id, eviction_mode mode = eviction_mode::automatic);  // false if it cannot

  buffer_state state(buffer_id id) const;
  std::size_t size(buffer_id id) const;
  // What a policy would be told about the buffer now (cost, neighbourhood cost, staleness), or
  // nullopt when it is not a candidate (pinned, not resident, not evictable). For tools and tests.
  std::optional<candidate_info> describe_candidate(buffer_id id) const;
  // The candidates that cost least per byte to drop (recompute with the neighbourhood), cheapest
  // first, at most `k` and 16: those that join every sample of dtr and dtr-frag (Note [Eviction
  // policies]). A candidate that cannot be dropped is never among them. For tools and tests.
  std::vector<buffer_id> cheapest_to_drop(std::size_t k) const;
  engine_stats stats() const;
  const cost_model& costs() const noexcept;
  device_allocator& allocator() const noexcept;

  struct impl;  // internal (eviction/src/engine_impl.hpp)

 private:
  friend class pinned_buffer;
  std::unique_ptr<impl> impl_;
};

}  // namespace spillway::eviction
