// engine_impl.hpp (internal): the eviction engine's state and its named steps.
//
// Methods ending in _locked assume the engine mutex is held (engine_lock). Files:
//   engine.cpp            public API: registration, lineage, pin/unpin, forget, queries
//   engine_pin_together.cpp  pin_all and a recompute's inputs: pinned together, let go to fit
//   engine_spill.cpp      spill to pinned host, restore, in-flight copy bookkeeping, events
//   engine_recompute.cpp  drop, recursive rematerialisation
//   engine_neighbourhood.cpp  DTR's classes of dropped buffers and each buffer's neighbourhood cost
//   engine_pressure.cpp   the allocator's pressure handler, victim choice, the candidate view
//   engine_compaction.cpp emptying segments by moving buffers into other segments' holes
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "registry.hpp"
#include "spillway/errors.hpp"
#include "spillway/eviction/engine.hpp"
#include "spillway/eviction/host_pool.hpp"

namespace spillway::eviction {

// The thrashing bound's out_of_memory (check_thrashing_locked), and that of plans nested past
// max_nested_plans (throw_nested_plans_locked). A recompute plan that lets its
// held outputs go to try a node again on out_of_memory (Note [Recompute plans hold their
// outputs]) lets this one through: the same node would be refused again.
class thrashing : public out_of_memory {
 public:
  using out_of_memory::out_of_memory;
};

// Makes room for one more element, so that the push_back after it cannot throw; grows
// geometrically (reserve(size() + 1) allocates exactly that much: every push would copy them all).
template <class T>
void reserve_one_more(std::vector<T>& v) {
  if (v.size() == v.capacity()) v.reserve(std::max<std::size_t>(8, 2 * v.capacity()));
}

// The way in of the engine's pressure handler. The allocator runs its handlers from a snapshot of
// its list, without its lock, so a call may start after remove_pressure_handler has returned: the
// handler holds this gate (shared), not the engine, and the engine's destructor closes it and waits
// for the calls under way before it tears anything down. Its mutex is a leaf: held only to count
// calls, never while one runs (Note [Eviction lock order]).
struct pressure_gate {
  pressure_result call(const pressure_request& request);  // nothing freed once closed
  void close() noexcept;  // waits for the calls under way; not from inside one

  eviction_engine::impl* engine = nullptr;
  std::mutex mutex;
  std::condition_variable idle;
  std::size_t calls = 0;  // under way
  bool closed = false;
};

struct eviction_engine::impl {
  impl(eviction_engine& self, device_allocator& allocator, engine_config config);

  // --- state -------------------------------------------------------------------------------------
  eviction_engine& self;
  device_allocator& allocator;
  device_backend& backend;
  engine_config config;
  std::unique_ptr<eviction_policy> policy;
  std::unique_ptr<cost_model> costs;
  host_pool host;
  stream_ref d2h_stream;   // dedicated copy streams
  stream_ref h2d_stream;

  mutable std::mutex mutex;
  std::atomic<std::thread::id> lock_owner{};  // see Note [Eviction lock order]

  detail::slot_arena<detail::buffer_entry> buffers;
  detail::slot_arena<detail::node_entry> nodes;
  detail::candidate_set candidates;
  std::unordered_map<void*, detail::buffer_entry*> by_pointer;  // resident device pointers
  std::vector<detail::buffer_entry*> in_flight;  // spilling or restoring, waiting on an event
  std::vector<event_ref> idle_events;
  // The bytes of the device-to-host copies queued and not yet completed: what a new spill waits
  // behind on the copy engine (cost_model::spill_cost_ns). A copy whose buffer stops waiting for
  // it (restored, or its host copy discarded, while spilling) still holds the engine: its bytes
  // stay counted until its event completes (detached_d2h, reaped with in_flight).
  std::size_t d2h_queued_bytes = 0;
  struct detached_copy {
    event_ref done;      // completes once the copy has (the spill's own event, or one after it)
    std::size_t bytes;
  };
  std::vector<detached_copy> detached_d2h;
  // host.room() as the current decision saw it (refreshed before each): a buffer the host pool
  // has no room for is described, and evicted, as a drop, not priced as a spill it cannot make.
  std::size_t host_room = SIZE_MAX;
  // DTR's classes (engine_neighbourhood.cpp): records recycled through a free list.
  std::vector<std::unique_ptr<detail::dtr_class>> class_records;
  std::vector<detail::dtr_class*> idle_classes;
  std::uint64_t upkeep_mark = 0;   // the last mark handed out to an upkeep step
  bool neighbourhood_lost = false; // an upkeep step ran out of host memory: estimates are 0 since
  detail::access_profile access;   // next-use prediction, once steps are marked (begin_step)
  engine_stats stats;
  pressure_handler_id handler_id = 0;
  std::shared_ptr<pressure_gate> gate = std::make_shared<pressure_gate>();
  // Streams that register_buffer found the device knows (check_stream_locked), so that each
  // costs one event record, not one per registration.
  std::vector<stream_ref> known_streams;
  // Entries to release, threaded through buffer_entry::release_next: release_entry_locked's
  // cascade runs as a loop over it, not as a recursion.
  detail::buffer_entry* release_stack = nullptr;
  bool releasing = false;  // a release_entry_locked call is draining release_stack
  // Note [Thrashing bound]: the cost and the number of the live lineage nodes (add_node adds,
  // retiring subtracts), and what the caller's pin or pin_all under way has recomputed so far.
  double lineage_cost_ns = 0;
  std::size_t lineage_nodes = 0;
  double call_recompute_ns = 0;
  std::size_t call_recomputes = 0;

  // --- engine_pin_together.cpp ---------------------------------------------------------------------
  void pin_together_locked(std::span<detail::buffer_entry* const> entries, std::size_t depth);
  // Entries marked wanted_now by pin_together calls that have let their pins go: while there are
  // none, describe_candidate_locked reads no entry behind a candidate's record.
  std::size_t wanted_now_entries = 0;

  // --- engine.cpp ----------------------------------------------------------------------------------
  // The staleness clock: the configured clock, but never behind the recomputes the engine has run.
  // See Note [Staleness clock] in docs/eviction.md.
  // Never throws: a clock that throws is read as the last time it gave (now() is called between
  // taking a pin and handing it out, and from noexcept unpins).
  std::uint64_t now() const noexcept {
    std::uint64_t t = last_clock;
    if (!config.clock) {
      t = steady_now();
    } else {
      try {
        t = config.clock();
        last_clock = t;
      } catch (...) {
      }
    }
    return std::max(t, recompute_time_floor);
  }
  mutable std::uint64_t last_clock = 0;  // the user clock's last reading
  std::uint64_t recompute_time_floor = 0;  // now() as of the last recompute, plus its cost
  static std::uint64_t steady_now() noexcept;
  detail::buffer_entry& lookup_locked(buffer_id id, const char* operation) const;
  detail::node_entry& lookup_node_locked(node_id id, const char* operation) const;
  void pin_locked(detail::buffer_entry& e);
  void note_access_locked(std::span<detail::buffer_entry* const> entries);
  void unpin_locked(detail::buffer_entry& e) noexcept;
  // A pin that is not a use (last_access_ns unchanged): the engine keeping e resident for a while.
  void hold_locked(detail::buffer_entry& e) noexcept;
  void release_hold_locked(detail::buffer_entry& e) noexcept;
  void update_candidacy_locked(detail::buffer_entry& e);
  // e's block is the one `info` describes (at registration; note_block_locked asks the allocator).
  static void note_block(detail::buffer_entry& e, const allocation_info& info) noexcept;
  void note_block_locked(detail::buffer_entry& e) noexcept;
  void attach_output_locked(detail::buffer_entry& e, detail::node_entry& n, std::uint32_t index);
  void detach_output_locked(detail::buffer_entry& e) noexcept;
  void release_entry_locked(detail::buffer_entry& e) noexcept;
  void free_entry_locked(detail::buffer_entry& e) noexcept;  // one step of release_entry_locked
  void retire_node_locked(detail::node_entry& n) noexcept;
  void check_stream_locked(stream_ref s, void* ptr);  // register_buffer's: invalid_argument

  // --- engine_spill.cpp ----------------------------------------------------------------------------
  event_ref take_event_locked();
  void give_event_locked(event_ref e) noexcept;
  bool spill_locked(detail::buffer_entry& e);
  void restore_locked(detail::buffer_entry& e);
  void reap_in_flight_locked();
  void abort_if_pinned_locked() noexcept;  // the destructor's check (engine.cpp)
  void destroy_copy_streams() noexcept;     // d2h and h2d, those made
  // A spill's copy that its buffer no longer waits for: its bytes leave d2h_queued_bytes when it
  // completes. `done` is the spill's event, handed over, or null: an event is recorded after it on
  // the d2h stream (if that cannot be done, the bytes leave the count at once).
  void detach_d2h_copy_locked(event_ref done, std::size_t bytes) noexcept;
  void discard_host_copy_locked(detail::buffer_entry& e) noexcept;
  void order_after_locked(stream_ref waiter, stream_ref producer);
  void use_on_stream_locked(detail::buffer_entry& e, stream_ref s);

  // --- engine_recompute.cpp ------------------------------------------------------------------------
  void make_resident_locked(detail::buffer_entry& e, std::size_t depth);
  std::vector<detail::node_entry*> plan_recompute_locked(detail::node_entry& top, std::size_t depth);
  void rematerialise_locked(detail::node_entry& top, std::size_t depth);
  bool can_drop_locked(const detail::buffer_entry& e) const noexcept;
  void drop_locked(detail::buffer_entry& e) noexcept;
  void recompute_locked(detail::node_entry& n, std::size_t depth);
  std::string order_output_locked(detail::buffer_entry& out, stream_ref made_on) noexcept;
  void check_thrashing_locked(const detail::node_entry& n) const;  // before n runs again
  out_of_memory::details thrashing_details_locked() const;
  // Past max_nested_plans (rematerialise_locked): thrashing.
  [[noreturn]] void throw_nested_plans_locked(const detail::node_entry& top, std::size_t depth) const;

  // --- engine_neighbourhood.cpp ----------------------------------------------------------------------
  void settle_cost_order_locked() noexcept;  // places candidates whose cost changed (cost_order.hpp)
  void set_state_locked(detail::buffer_entry& e, buffer_state s) noexcept;  // keeps the classes
  void graph_insert_locked(detail::buffer_entry& e) noexcept;  // registered / lineage changed
  void graph_remove_locked(detail::buffer_entry& e) noexcept;  // forgotten / lineage changing
  void join_class_locked(detail::buffer_entry& t);
  void leave_class_locked(detail::buffer_entry& t);
  void split_class_locked(detail::dtr_class& c, detail::buffer_entry& t,
                          const std::vector<detail::buffer_entry*>& ends, double old_cost);
  void add_to_boundaries_locked(detail::buffer_entry& e);
  void remove_from_boundaries_locked(detail::buffer_entry& e) noexcept;
  void set_neighbourhood_locked(detail::buffer_entry& e, double cost_ns) noexcept;
  // What dropping e adds to its own recompute cost: its neighbourhood, less its producer's cost
  // where a dropped sibling's class counts that already (the policies' neighbourhood cost).
  double charged_neighbourhood_locked(const detail::buffer_entry& e) const noexcept;
  detail::dtr_class* make_class_locked();
  void free_class_locked(detail::dtr_class* c) noexcept;
  void lose_neighbourhood_locked() noexcept;
  void forget_class_next_reads_locked() noexcept;  // begin_step: the record they were found in is gone
  // The earliest next read of the dropped classes that e's consumers' outputs belong to: when a
  // dropped dependant of e is needed, and e with it as an input of its recompute.
  std::uint32_t dependants_next_read_locked(const detail::buffer_entry& e) const noexcept;
  // When e is next needed: the earlier of its own next read and its dependants' (no_event
  // without a prediction of its own).
  std::uint32_t needed_next_locked(const detail::buffer_entry& e) const noexcept;

  // --- engine_compaction.cpp -----------------------------------------------------------------------
  // Note [Compaction]: empties fixed segments by moving their buffers, before any eviction; returns
  // the bytes of the segments it emptied and adds the bytes moved to result.freed.
  std::size_t compact_for_locked(const eviction_request& request, pressure_result& result);
  bool movable_locked(const segment_usage& s, bool other_streams,
                      std::vector<detail::buffer_entry*>& out) const;
  enum class segment_move { emptied, no_room, copy_failed };
  segment_move empty_segment_locked(const segment_usage& s, std::vector<detail::buffer_entry*>& movers,
                                    std::vector<void*>& targets, pressure_result& result);
  bool move_locked(detail::buffer_entry& e, void* target);

  // --- engine_pressure.cpp -------------------------------------------------------------------------
  pressure_result on_pressure(const pressure_request& request);
  pressure_result evict_for_locked(const eviction_request& request);
  bool evict_locked(detail::buffer_entry& e, eviction_mode mode);
  candidate_info describe_candidate_locked(const detail::candidate_record& r, std::uint64_t now) const noexcept;
  void describe_wanted_now_locked(const detail::buffer_entry& e, candidate_info& c,
                                  double& neighbourhood) const noexcept;
  detail::candidate_record make_record_locked(detail::buffer_entry& e) const noexcept;
  // The key of the candidate set's cost order: what dropping it costs per byte (recompute with its
  // neighbourhood); infinite (never joined) if it cannot be dropped. Never NaN.
  double cost_per_byte_locked(const detail::candidate_record& r) const noexcept;
  void* allocate_locked(std::size_t bytes, stream_ref stream);
};

// Takes the engine mutex and records the owning thread, so that a pressure callback arriving on
// this thread (from an allocation the engine makes) knows it already holds the lock.
class engine_lock {
 public:
  explicit engine_lock(eviction_engine::impl& m) : m_(m), lock_(m.mutex) {
    m_.lock_owner.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  ~engine_lock() { m_.lock_owner.store(std::thread::id{}, std::memory_order_relaxed); }
  engine_lock(const engine_lock&) = delete;
  engine_lock& operator=(const engine_lock&) = delete;

 private:
  eviction_engine::impl& m_;
  std::lock_guard<std::mutex> lock_;
};

std::string describe_id(buffer_id id);

}  // namespace spillway::eviction
