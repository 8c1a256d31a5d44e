// activation_manager: activations saved for backward, evicted under memory pressure and made
// resident again on use. One implementation for both ways in: the Python package's
// spillway.activations() (saved-tensor hooks) and LibTorch programs (libtorch_activations.hpp).
//
// Contract
// - pack(tensor) registers a tensor autograd saves, by *storage*: views and aliases of one storage
//   share one entry. It returns the handle autograd keeps instead of the tensor, or nullptr for a
//   tensor to keep as it is (smaller than min_bytes, a parameter: a leaf that requires grad, or
//   not on a CPU or CUDA device).
// - A storage is evictable only when nothing but the handles' aliases holds it (the storage's use
//   count equals the aliases plus the entry's own reference): a tensor the program still uses, a
//   weight, or a tensor a running backward node just unpacked is never touched.
// - Eviction keeps the StorageImpl and swaps its memory out (a null DataPtr, 0 bytes), so every
//   view stays valid and sees the bytes again once restored. It spills (a copy to host memory:
//   for CUDA pinned, on a dedicated device-to-host stream, the block record_stream'ed onto it so
//   that it is freed in stream order after the copy; for CPU torch's default CPU allocator's,
//   never an installed one, which may be the budget spilled from) or drops (only for storages a
//   checkpoint segment saved: the segment is their lineage). Per storage, by cost: the segment's
//   measured forward time against the spill's: its wait behind the manager's copies to host
//   memory that hold the device's copy engine, its own copy out and the copy back, at the link's
//   bandwidth in each direction, measured from the copies of every manager of the process, per
//   device (link_bandwidth until the first, or always if set: activation_link.hpp; stats:
//   spill_bytes_per_s, restore_bytes_per_s). Modes spill and drop force one kind.
// - unpack(handle) makes the storage resident and returns a fresh alias (so the storage is not
//   evictable while autograd uses it): a spilled one is copied back on a host-to-device stream that
//   the current stream then waits for; a dropped one is recomputed by its segment's replay, run
//   with the default CPU and CUDA generators set to their state at the segment's start (and put
//   back afterwards); every dropped storage of the segment is refilled from the tensors the replay
//   saved, matched by save order (taking over the memory of those only the replay held, without
//   an allocation or a copy; copying the others). A replay that saves tensors of other sizes fails
//   with std::runtime_error ("not deterministic"), changing nothing. When no output of the
//   segment is dropped, the replay stops after the last save that is (as torch.utils.checkpoint's
//   early stop): what backward has consumed already is neither recomputed nor allocated again
//   (stats: recomputes_stopped); a storage after that point dropped by the replay's own pressure
//   stays dropped, restored when it is used. Only the replay a restore runs last stops early
//   (one run for another's inputs runs to the end). A binding's replay treats any end of the run
//   after the stop (the stop's exception wrapped by an interpreter, caught by user code, or a
//   normal return) as the stop: it gives back the saves up to it, never what ran after.
// - Segment inputs: begin_segment holds a segment's tensor inputs the way it holds saved storages
//   (an entry per storage), so once the program lets go of them they are evictable like any saved
//   activation: a checkpoint boundary is not pinned for the segment's lifetime. A storage that is
//   an output of the segment ended last (end_segment's outputs, not modified in place since) has
//   that segment as its lineage when it is first registered, as an input or a save outside any
//   segment: its replay returns it again, so it can be dropped; any other new input has none, and
//   can only be spilled. A replay first makes its inputs resident: a
//   spilled one is copied back, a dropped one (the output of an earlier segment) is recomputed by
//   that segment first. Every segment needed that way, through any input and those segments'
//   inputs in turn, is replayed producers first, in a loop rather than by recursion, and what
//   each restores for another is held until the replay that reads it has run (each needed
//   segment is replayed once per restore). A replay nests another only
//   when it reads, itself, dropped storages that are not its inputs; nested more than 64 deep,
//   it fails with std::runtime_error (stats: nested_recomputes). DTR's cost of dropping a storage is its segment's forward time
//   plus that of the earlier segments its replay would have to run first.
// - In-place changes (tensor version counters): a storage is dropped only if its version is the
//   one its lineage gives back (as at its segment's end, or when it was registered as an
//   output) and the segment's inputs are as they were when it began; a segment that modifies an
//   input in place has nothing dropped once that is seen (its replay would start from other
//   bytes). An input modified after its segment's storages were dropped (later in that segment,
//   or after it) makes the replay fail with std::runtime_error, never refill wrong bytes.
// - After each unpack the next spilled storages that autograd will unpack, in backward order
//   (reverse pack order), start copying back, so that copies overlap compute: up to the prefetch
//   depth, at most `prefetch`, which halves when storages restored ahead are evicted unread (at
//   most once between two unpacks: one loss event), and grows by one whenever an unpack finds
//   its storage still spilled and waits for its copy (stats: prefetch_depth, unpacks_waiting;
//   additive increase, multiplicative decrease, as a congestion window). A storage restored
//   ahead and let go unread (autograd released a node it never ran) counts in
//   prefetches_unused but does not back off: no room ran out. A storage
//   held only as a segment's input is restored by the replay that reads it. A storage restored
//   ahead keeps its host copy (if its tensor has a version counter), so that evicting it again
//   before its unpack copies nothing: its bytes are still the host copy's, as nothing but the
//   manager holds it and its version is unchanged (stats: clean_evictions, kept_host_bytes). The
//   copy goes at its unpack, when it is dropped or forgotten, when its version has changed, and
//   for a spill's host memory: the kept copies count against max_spilled, and those unpacked
//   soonest go first when a spill needs their room or its host allocation fails. One evicted or
//   let go before its unpack counts in stats' prefetches_unused. The unpacked storage is already held by
//   the returned alias then, so a prefetch's allocation under pressure cannot evict it; a
//   prefetch out of memory stops prefetching (the entry is restored when it is unpacked).
// - Pressure: whenever the resident bytes of evictable saved storages (those only the manager
//   holds) exceed max_resident (at every pack and unpack, and when a scope ends), and, when
//   constructed with a plugin_allocator, whenever one of its allocations does not fit the budget
//   (a pressure handler, which evicts only storages whose memory is that device's, first those
//   whose free makes a free range that fits the request or gives back the budget's shortfall,
//   then those that grow the largest range: not merely enough bytes; a manager busy on another
//   thread answers "nothing" instead of waiting, which could deadlock).
// - Host memory: a spill that would take spilled and kept copies over max_spilled bytes (after
//   letting kept copies go), or whose host
//   buffer cannot be allocated (pinned memory exhausted), is not made, and nothing is lost: the
//   storage is dropped instead when its segment can recompute it (modes hybrid and drop), else it
//   stays resident and the next victim is tried (stats: spill_fallbacks). A call that runs out
//   of host memory otherwise (std::bad_alloc, from the manager or LibTorch under it) throws and
//   leaves every entry as it was or as it would have been: none half-made, none lost, its byte
//   counts exact (Note [Host out of memory]; tests/test_libtorch_host_faults.cpp).
// - Victims: dtr (smallest restore cost / (bytes x staleness)), lru, or largest, chosen among
//   every evictable storage when there are at most 256 resident ones, else among a uniform
//   sample of 256 per victim, drawn from the resident storages only, as DTR samples
//   (bench/activation_evict_bench.py measures it; stats: evict_ns, the host time evicting).
// - Thread-safe: one recursive mutex (autograd runs backward on its own threads; an allocation the
//   manager makes may come back as pressure on the same thread). Replays run under it.
// - Bad options throw spillway::invalid_argument naming the value and what was expected.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "activation_link.hpp"
#include "plugin_allocator.hpp"

namespace spillway::torch_plugin {

enum class activation_mode { hybrid, spill, drop };
enum class activation_policy { dtr, lru, largest };

activation_mode parse_activation_mode(std::string_view name);      // "hybrid" | "spill" | "drop"
activation_policy parse_activation_policy(std::string_view name);  // "dtr" | "lru" | "largest"

struct activation_options {
  std::optional<std::size_t> max_resident;  // evictable saved bytes kept resident; none: no cap
  activation_mode mode = activation_mode::hybrid;
  activation_policy policy = activation_policy::dtr;
  std::size_t prefetch = 2;
  std::size_t min_bytes = std::size_t{64} << 10;
  // The host link's bytes per second, each way; none: measured from the manager's copies,
  // default_link_bandwidth until the first.
  std::optional<double> link_bandwidth;
  static constexpr double default_link_bandwidth = 25e9;
  std::optional<std::size_t> max_spilled;   // host bytes spilled and kept copies may hold; none: no cap
  // Where spilled copies of CPU storages go; nullptr: torch's default CPU allocator (never the
  // one installed, see copy_out). CUDA storages always spill to pinned memory.
  c10::Allocator* host_allocator = nullptr;
};

struct activation_stats {
  std::uint64_t packed = 0, evictions = 0, spills = 0, drops = 0, restores = 0, recomputes = 0,
                recompute_moves = 0,  // dropped storages refilled by taking the replay's memory
                recomputes_stopped = 0,  // replays stopped after the last save they had to give
                nested_recomputes = 0,  // replays run to restore another replay's inputs
                spill_fallbacks = 0,  // spills not made for want of host memory (see evict)
                bytes_spilled = 0, bytes_dropped = 0, bytes_restored = 0, prefetches = 0,
                prefetches_unused = 0,  // restored ahead, then evicted or let go unread
                clean_evictions = 0,  // evicted to the host copy kept since a prefetch: no copy
                unpacks_waiting = 0,  // unpacks that found their storage spilled: a copy waited for
                pressure_calls = 0,
                evict_ns = 0;  // host time in evict and the pressure handler: choice and eviction
  std::uint64_t registered = 0, resident_bytes = 0, spilled_bytes = 0, dropped_bytes = 0;
  std::uint64_t kept_host_bytes = 0;  // host copies kept by storages restored ahead
  // A manager's own, listed by fields() only then (has_link), not in totals():
  // the storages its next unpack may restore ahead, at most;
  std::uint64_t prefetch_depth = 0;
  // the bandwidth it weighs spills by, each way, on the link of its last copy (activation_link.hpp).
  std::uint64_t spill_bytes_per_s = 0, restore_bytes_per_s = 0;
  bool has_link = false;
  std::vector<std::pair<std::string, std::uint64_t>> fields() const;  // name, value
};

// What a checkpoint segment's run gives: every tensor it saved for backward, in order, and the
// tensors it returned, in order; or, when it stopped early (stopped), the saves up to where it
// was asked to stop, and no outputs.
struct segment_run {
  std::vector<at::Tensor> saved, outputs;
  bool stopped = false;
};

// Re-runs a checkpoint segment on `inputs` (the tensors begin_segment got, resident again). The
// binding implements it (Python: saved_tensors_hooks; LibTorch: the engine's default hooks), and
// keeps BatchNorm running statistics from being updated twice. With `stop_after_saves`, nothing
// after that many saves is wanted: the replay may stop there (the rest of the segment is not
// run) and say so in segment_run::stopped, or run to the end; without it, it runs to the end.
using segment_replay = std::function<segment_run(const std::vector<at::Tensor>& inputs,
                                                 std::optional<std::size_t> stop_after_saves)>;

struct segment_input;  // activation_manager_impl.hpp

class activation_manager : public std::enable_shared_from_this<activation_manager> {
 public:
  struct entry;
  struct segment;

  // What autograd keeps for one saved tensor: an alias of its storage. Dropping it releases the
  // entry once no handle of that storage is left.
  class saved {
   public:
    saved(std::shared_ptr<activation_manager> manager, entry* e, at::Tensor alias,
          bool by_autograd);
    ~saved();
    saved(const saved&) = delete;
    saved& operator=(const saved&) = delete;

   private:
    friend class activation_manager;
    std::shared_ptr<activation_manager> manager_;
    entry* entry_;
    at::Tensor alias_;
    bool by_autograd_;  // made by pack: autograd unpacks it
  };

  // Use make(): handles keep the manager alive through shared_from_this.
  static std::shared_ptr<activation_manager> make(activation_options options,
                                                  plugin_allocator* pressure_source = nullptr);
  ~activation_manager();
  activation_manager(const activation_manager&) = delete;
  activation_manager& operator=(const activation_manager&) = delete;

  std::shared_ptr<saved> pack(const at::Tensor& tensor);
  at::Tensor unpack(const saved& handle);

  // A checkpoint segment runs between begin_segment and end_segment: the storages it saves get
  // `replay` as their lineage. cuda_devices: the devices whose generators the segment uses.
  // inputs: the segment's tensor inputs, which the manager holds for the replay as it holds saved
  // storages (evictable: see the contract), and hands to it resident again. outputs: the tensors
  // the segment returned, in the order its replay returns them (their lineage, when they are
  // registered, unchanged, before another segment ends).
  void begin_segment(segment_replay replay, std::vector<c10::DeviceIndex> cuda_devices,
                     const std::vector<at::Tensor>& inputs);
  void end_segment(double host_seconds, const std::vector<at::Tensor>& outputs = {});

  // Evicts until `wanted` bytes are freed or nothing evictable is left; with `memory_of`, only
  // storages whose memory is a live allocation of that allocator (the pressure handler's: evicting
  // a CPU storage, or another GPU's, frees nothing there). Returns (freed, pinned): pinned is what
  // is resident and may not be evicted now (of `memory_of`, if given).
  std::pair<std::size_t, std::size_t> evict(std::size_t wanted,
                                            const device_allocator* memory_of = nullptr);
  // The allocator's pressure handler: evicts storages of `memory` until `request` can be served,
  // preferring victims whose free makes a range that fits it (activation_eviction.cpp). Returns
  // (freed, pinned) as evict does, pinned only when it freed less than it was asked for (0
  // otherwise: it says why a request fails, and counting it walks every resident storage).
  std::pair<std::size_t, std::size_t> evict_for(const pressure_request& request,
                                                const device_allocator& memory);
  void enforce_max_resident();
  // A scope of saves (spillway.activations(), activation_scope) ends: enforces max_resident, and
  // lets go of the segment that ended last (a storage registered after this takes no lineage
  // from it). Until then that segment holds its inputs, and they hold the manager.
  void end_scope();

  activation_stats stats() const;
  // "resident", "spilled" or "dropped" for the entry of `tensor`'s storage; nullopt if none.
  std::optional<std::string> state_of(const at::Tensor& tensor) const;
  const activation_options& options() const noexcept { return options_; }

  void close();  // stops answering the allocator's pressure; saved activations stay usable

  // Every live manager's statistics plus those of managers already gone (spillway.stats()).
  static activation_stats totals();

 private:
  activation_manager(activation_options options, plugin_allocator* pressure_source);

  std::shared_ptr<saved> hold(const at::Tensor& tensor, bool saved_by_autograd);
  std::shared_ptr<segment> producer_of(const at::Tensor& tensor);
  void release(saved& handle) noexcept;
  void forget(entry& e);
  bool evictable(const entry& e) const;
  bool droppable(const entry& e) const;  // its lineage can give its bytes back
  bool inputs_unchanged(const segment& s) const;
  void settle_last_ended();
  bool settled(const segment& s) const;  // every output of s gone or registered
  std::pair<double, bool> restore_cost(entry& e);  // seconds, true = drop
  double score(entry& e, double now);  // the policy's: the smallest is the best victim
  std::size_t sample_victims(const device_allocator* memory_of, const std::vector<entry*>& tried);
  void became_resident(entry& e) noexcept;  // resident_ and resident_bytes_ follow the state
  void left_resident(entry& e) noexcept;
  void swap_resident(std::size_t i, std::size_t j) noexcept;
  std::size_t pinned_bytes(const device_allocator* memory_of) const;
  std::size_t evict_one(entry& e);
  at::Tensor spill_buffer(const entry& e);  // undefined: no host memory for it
  void copy_out(entry& e, at::Tensor host);
  // keep_host: the host copy stays the entry's (a prefetch's; see let_go_of_host).
  void copy_in(entry& e, bool keep_host = false);
  // A resident entry's kept host copy goes (at its unpack, drop or end, or for a spill's room).
  void let_go_of_host(entry& e) noexcept;
  void let_go_of_kept(std::size_t bytes) noexcept;  // kept copies of at least `bytes`, or all
  bool room_for_spill(std::size_t nbytes);  // within max_spilled, letting kept copies go
  void note_copies() noexcept;  // scan_copies over timed_copies_ (activation_link.hpp)
  void copy_on_host(const at::Tensor& to, const at::Tensor& from, link_direction d);
  void room_for_copy(c10::DeviceIndex device);  // may throw std::bad_alloc
  struct timed_copy;
  void list_copy(timed_copy copy) noexcept;
  void used_link(int device) noexcept {  // a copy was made on it (-1: a CPU storage's)
    link_device_ = device;
    link_copied_ = true;
  }
  void make_resident(entry& e);
  // inputs: resident. may_stop: nothing but the dropped members of `s` is wanted from it (no
  // restore waits on its other outputs or saves), so its replay may stop early (early_stop).
  void recompute(segment& s, bool nested, std::vector<at::Tensor> inputs, bool may_stop);
  // How many saves a replay of `s` must give back (segment_replay); nullopt: all, and its outputs.
  static std::optional<std::size_t> early_stop(const segment& s, const std::vector<entry*>& members);
  // The segment that returned `in`, if `in` is dropped: replayed, it gives it back.
  static segment* dropped_producer(const segment_input& in);
  double segment_cost(segment& s, int depth);  // with the dropped segments it needs first
  double measured_cost(segment& s);            // its forward's time (so far, if it runs)
  void prefetch_before(std::uint64_t seq);
  at::Tensor read_for_replay(const saved& handle);  // a replay's input: unpack without autograd's part
  static at::Tensor alias_in_use(const saved& handle);  // a fresh alias; a use of the entry
  static void wait_for_copy_back(entry& e);  // the current stream waits for e's copy back
  // e, restored ahead, goes unread: counted; evicted (the room ran out), the depth backs off.
  void prefetch_wasted(entry& e, bool evicted) noexcept;
  bool room_to_prefetch(const entry& e) const;
  std::size_t evictable_resident_bytes() const;
  void note_saved(entry* e);

  activation_options options_;
  plugin_allocator* pressure_source_;
  std::uint64_t pressure_handler_ = 0;
  mutable std::recursive_mutex mutex_;
  std::unordered_map<c10::StorageImpl*, std::unique_ptr<entry>> entries_;
  std::map<std::uint64_t, entry*> spilled_;  // by pack order, for prefetch
  // Segments are per thread: one begins, saves and ends on the thread that runs it, and threads
  // inside the same manager must not take each other's segments as lineage (a save listed in
  // another thread's segment would be refilled from the wrong position of its replay). For each
  // thread, the segments open (innermost last) and the one that ended last, whose outputs a new
  // entry may be: kept until the next one ends on that thread or its scope does (end_scope),
  // since nothing else may hold it yet. A thread's record goes when both are empty.
  struct thread_segments {
    std::vector<std::shared_ptr<segment>> open;
    std::shared_ptr<segment> last_ended;
  };
  std::unordered_map<std::thread::id, thread_segments> segments_by_thread_;
  thread_segments* this_thread_segments();  // null if this thread has none
  std::uint64_t next_seq_ = 0;
  // Every resident entry, in no order (entry::resident_at is its index): victims are sampled from
  // it. Its capacity is kept at least entries_.size(), so that adding to it never allocates.
  std::vector<entry*> resident_;
  std::size_t resident_bytes_ = 0;  // theirs
  std::size_t spilled_bytes_ = 0;  // held by spilled copies in host memory
  // Host copies kept by storages restored ahead, until their unpack (prefetch_before): with
  // spilled_bytes_, what max_spilled caps.
  std::size_t kept_host_bytes_ = 0;
  // How many spilled storages an unpack restores ahead (prefetch_before): at most
  // options_.prefetch; halved when prefetches are evicted unread (once between two unpacks:
  // backed_off_), one more after each unpack that waited.
  double prefetch_depth_ = 0;
  bool backed_off_ = false;
  link_meter link_;
  int link_device_ = -1;  // of its last copy, else of its first CUDA entry: the link stats() reports
  bool link_copied_ = false;  // it has made a copy
  // CUDA copies not sampled yet, in the order they were queued, with timing events around each
  // and, for a copy to host memory, the event its copy stream waits for (once complete, the copy
  // holds the copy engine: activation_link.hpp, occupancy). Room is reserved before a copy is
  // queued, so that listing it never allocates.
  struct timed_copy {
    c10::DeviceIndex device;
    link_direction direction;
    std::size_t bytes;
    c10::Event start, end;
    std::optional<c10::Event> ready;
    bool eligible = false;  // `ready` is known complete
  };
  std::vector<timed_copy> timed_copies_;
  int replay_depth_ = 0;           // replays running on the thread that holds mutex_
  std::uint64_t sample_state_ = 0x2545F4914F6CDD1DULL;  // SplitMix64: victims' samples
  activation_stats counters_;
};

}  // namespace spillway::torch_plugin
