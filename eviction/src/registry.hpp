// registry.hpp (internal): the records of evictable buffers and lineage nodes, DTR's classes of
// dropped buffers, and the candidate set the policies choose from.
//
// - Records live in slot arenas; an id is (slot index + 1) | generation << 32, so an id used after
//   forget() is recognised as stale. Making and recycling records never touches the heap once the
//   arena has grown to the working set.
// - dtr_class: a connected set of dropped buffers in the lineage graph (DTR's evicted
//   neighbourhood), with the buffers next to it. Kept exact as buffers are dropped, brought back,
//   registered and forgotten (engine_neighbourhood.cpp), so that every buffer that is not dropped
//   knows its neighbourhood cost without walking the graph.
// - candidate_set holds the eviction candidates (resident, unpinned, evictable) four ways: a
//   vector of candidate_record by value for O(1) random access (sampling reads one cache line per
//   candidate), and, intrusive on the buffer records, an LRU list, a size-ordered tree and a tree
//   ordered by what evicting each costs per byte (the cheapest join every DTR sample).
//   See Note [Eviction state machine] and Note [Eviction policies] in docs/eviction.md.
#pragma once

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "access_profile.hpp"
#include "cost_order.hpp"
#include "spillway/eviction/buffer.hpp"
#include "spillway/eviction/lineage.hpp"

namespace spillway::eviction::detail {

namespace bi = boost::intrusive;

struct node_entry;
struct buffer_entry;

// A connected component of dropped buffers in the lineage graph (buffers are adjacent when one is
// an input of the other's producer, or both are outputs of one node): DTR's evicted
// neighbourhood, exact (Note [Eviction policies]).
struct dtr_class {
  struct neighbour {
    buffer_entry* buffer;  // not dropped, in the graph
    std::uint32_t edges;   // lineage edges between it and members (an input read twice counts twice)
  };
  double cost_ns = 0;                   // the members' producers' costs, each node once
  // The earliest of the members' next reads (buffer_entry::next_read): when the class
  // is next needed, so when the buffers it would be rematerialised from are (Note [Next-use
  // prediction]). access_profile::no_event without a prediction.
  std::uint32_t next_read = access_profile::no_event;
  std::vector<buffer_entry*> members;   // dropped buffers; buffer_entry::member_index is the index
  std::vector<neighbour> boundary;      // each buffer next to a member, once
  std::uint64_t mark = 0;               // scratch for one upkeep step
};

struct buffer_entry {
  bi::list_member_hook<bi::link_mode<bi::normal_link>> lru_hook;   // candidates, oldest first
  bi::set_member_hook<bi::link_mode<bi::normal_link>> size_hook;   // candidates by size
  bi::set_member_hook<bi::link_mode<bi::normal_link>> cost_hook;   // candidates by cost per byte
  bi::list_member_hook<bi::link_mode<bi::normal_link>> wait_hook;  // ... or waiting for a place there
  std::size_t candidate_index = no_index;                           // in candidate_set::all
  double cost_per_byte = 0;  // a candidate: its key in the cost order (candidate_set::insert, reorder)
  bool cost_waiting = false; // on the cost order's waiting list, not in its tree (cost_order.hpp)

  static constexpr std::size_t no_index = static_cast<std::size_t>(-1);

  buffer_id id;
  buffer_state state = buffer_state::resident;
  void* device_ptr = nullptr;      // resident / restoring
  void* host_ptr = nullptr;        // spilling / spilled
  std::size_t size = 0;
  stream_ref stream;
  // The stream its current block was allocated on, whose pool holds it (note_block): the
  // buffer's own stream, unless it was registered from another stream's allocation or recomputed
  // on its node's stream. A victim frees a range for a request of that stream and pool.
  stream_ref block_stream;
  std::vector<stream_ref> use_streams;  // other streams that use the current block (pin(id, use))
  bool small_pool = false;
  std::size_t segment_size = 0;     // resident: the segment that holds its block
  bool whole_segment = false;       // resident: its block is that whole segment
  std::uint32_t pins = 0;
  // Of those, the pins a caller took over from their guard (pinned_buffer::release), which
  // eviction_engine::unpin gives back; the others belong to live guards or to the engine itself.
  std::uint32_t released_pins = 0;
  std::uint64_t last_access_ns = 0;
  access_profile::step_key access_key;  // for next-use prediction (access_profile.hpp)
  // Its next read in the last step's record (access_profile::next_read), found when it last became
  // a candidate or was dropped: it is not read while it is either, so this holds until it leaves
  // that state or a step begins.
  std::uint32_t next_read = access_profile::no_event;
  node_entry* producer = nullptr;
  std::uint32_t output_index = 0;
  std::vector<node_entry*> consumers;  // live nodes that need it as an input (keep it alive)
  bool user_owned = true;           // false once forgotten (kept only while consumers need it)
  buffer_entry* release_next = nullptr;  // on impl::release_stack: the entry released after it
  bool evictable = true;
  // An entry of a pin_together that has let its pins go to fit (engine_pin_together.cpp): the op under way
  // needs it now. Note [Pinning together lets go to fit].
  bool wanted_now = false;
  eviction_mode mode = eviction_mode::automatic;
  event_ref spill_done;             // spilling: the device-to-host copy
  event_ref ready;                  // restoring: the host-to-device copy

  // DTR's evicted neighbourhood (engine_neighbourhood.cpp). A registered buffer is in the lineage
  // graph; dropped, it is a member of a class, otherwise it knows the cost of the classes next to it.
  bool in_graph = false;
  dtr_class* cls = nullptr;            // dropped and in the graph: its class
  std::uint32_t member_index = 0;      // in cls->members
  double member_cost_ns = 0;           // what it adds to its class: its producer's cost then, or
                                       // 0 where a dropped sibling holds that cost

  double neighbourhood_ns = 0;         // not dropped: the summed cost of the classes next to it
  std::uint64_t mark = 0;              // scratch for one upkeep step
  std::uint32_t scratch_index = 0;
  double scratch_cost = 0;
};

// A candidate as the policies see it, by value in the candidate vector: a sample reads only these
// (one cache line each), never the buffer, node and class records behind them.
// The costs are floats to keep it in 64 bytes: a score needs no more than 7 digits.
struct alignas(64) candidate_record {
  buffer_entry* entry = nullptr;
  buffer_id id;
  std::size_t size = 0;
  std::uint64_t last_access_ns = 0;
  stream_ref stream;
  std::size_t segment_size = 0;
  float recompute_ns = 0;        // its producer's cost (0 without lineage)
  float neighbourhood_ns = 0;    // kept equal to charged_neighbourhood_locked(*entry)
  // When it is next needed, as an event of the last step's record: the earlier of its own next
  // read (entry->next_read) and that of its dropped dependants' classes, which
  // set_neighbourhood_locked keeps current (Note [Next-use prediction]).
  std::uint32_t next_read = access_profile::no_event;
  eviction_mode mode = eviction_mode::automatic;
  bool small_pool : 1 = false;
  bool can_drop : 1 = false;     // lineage exists, drops are allowed, its mode allows it
  bool can_spill : 1 = false;    // spills are allowed and its mode allows it
  bool whole_segment : 1 = false;
};
static_assert(sizeof(candidate_record) == 64, "one cache line per candidate");

struct node_entry {
  std::uint64_t id = 0;
  bool alive = false;
  lineage_node desc;
  std::vector<buffer_entry*> inputs;      // resolved desc.inputs
  std::vector<buffer_entry*> outputs;     // by output index; nullptr if not registered
  std::vector<std::size_t> output_sizes;  // remembered for outputs that were forgotten
  std::uint32_t live_outputs = 0;
  stream_ref stream;                      // the stream of its first registered output
  bool visiting = false;                  // on the current rematerialisation path
  bool removed = false;                   // remove_node: no new outputs; retires with its last
  // The dropped output (a class member) that holds this node's cost in its class, or null
  // (engine_neighbourhood.cpp): the node's dropped outputs are one class and count it once.
  buffer_entry* cost_holder = nullptr;
};

// Slot arena with generation-checked ids.
template <class T>
class slot_arena {
 public:
  T* make(std::uint64_t& id_out) {
    std::uint32_t slot;
    if (free_.empty()) {
      slot = static_cast<std::uint32_t>(slots_.size());
      slots_.push_back({std::make_unique<T>(), 1, false});
      free_.reserve(slots_.size());
    } else {
      slot = free_.back();
      free_.pop_back();
    }
    slots_[slot].used = true;
    id_out = (static_cast<std::uint64_t>(slots_[slot].generation) << 32) | (slot + 1u);
    return slots_[slot].record.get();
  }
  // nullptr if the id was never issued or its record was recycled.
  T* find(std::uint64_t id) const noexcept {
    const std::uint64_t slot = (id & 0xffffffffu) - 1;
    if ((id & 0xffffffffu) == 0 || slot >= slots_.size()) return nullptr;
    const entry& e = slots_[slot];
    return e.used && e.generation == static_cast<std::uint32_t>(id >> 32) ? e.record.get() : nullptr;
  }
  bool stale(std::uint64_t id) const noexcept {  // issued once, recycled since
    const std::uint64_t slot = (id & 0xffffffffu) - 1;
    return (id & 0xffffffffu) != 0 && slot < slots_.size() &&
           static_cast<std::uint32_t>(id >> 32) < slots_[slot].generation;
  }
  void recycle(std::uint64_t id) noexcept {
    const std::uint32_t slot = static_cast<std::uint32_t>((id & 0xffffffffu) - 1);
    entry& e = slots_[slot];
    *e.record = T{};
    e.used = false;
    ++e.generation;
    free_.push_back(slot);
  }
  // Records ever made and not freed for good: at least the records in use.
  std::size_t slots() const noexcept { return slots_.size(); }
  template <class F>
  void for_each(F&& f) {
    for (auto& e : slots_) {
      if (e.used) f(*e.record);
    }
  }

 private:
  struct entry {
    std::unique_ptr<T> record;
    std::uint32_t generation;
    bool used;
  };
  std::vector<entry> slots_;
  std::vector<std::uint32_t> free_;
};

struct by_size {
  bool operator()(const buffer_entry& a, const buffer_entry& b) const noexcept {
    return a.size != b.size ? a.size < b.size : a.id.value < b.id.value;
  }
};

class candidate_set {
 public:
  using lru_list = bi::list<buffer_entry, bi::member_hook<buffer_entry, decltype(buffer_entry::lru_hook),
                                                          &buffer_entry::lru_hook>>;
  using size_tree = bi::set<buffer_entry, bi::member_hook<buffer_entry, decltype(buffer_entry::size_hook),
                                                          &buffer_entry::size_hook>,
                            bi::compare<by_size>>;

  ~candidate_set() {
    lru_.clear();
    sizes_.clear();
  }

  bool contains(const buffer_entry& e) const noexcept { return e.candidate_index != buffer_entry::no_index; }

  // Room for n candidates in all (grown geometrically): while at most n buffer records exist,
  // no insert throws, so that paths that cannot fail (an unpin, a recompute's last step, an
  // eviction given up) can make a buffer a candidate again.
  void reserve_total(std::size_t n) {
    if (n > all_.capacity()) all_.reserve(std::max(n, 2 * all_.capacity()));
  }
  // Adds as the most recently used; r.entry == &e.
  void insert(buffer_entry& e, const candidate_record& r, double cost_per_byte) {
    all_.push_back(r);  // the only step that may allocate: done first
    e.candidate_index = all_.size() - 1;
    lru_.push_back(e);
    sizes_.insert(e);
    by_cost_.insert(e, cost_per_byte);
  }
  void erase(buffer_entry& e) noexcept {
    all_[e.candidate_index] = all_.back();
    all_[e.candidate_index].entry->candidate_index = e.candidate_index;
    all_.pop_back();
    e.candidate_index = buffer_entry::no_index;
    lru_.erase(lru_.iterator_to(e));
    sizes_.erase(sizes_.iterator_to(e));
    by_cost_.erase(e);
  }
  // A candidate's cost per byte changed (its neighbourhood did): it moves in the cost order.
  void reorder(buffer_entry& e, double cost_per_byte) noexcept { by_cost_.reorder(e, cost_per_byte); }
  // Up to out.size() (at most 16) candidates, the cheapest per byte first, as indices for at().
  // At most cost_order's cached prefix: cheapest_per_byte hands out no more than this many.
  static constexpr std::size_t max_cheapest = cost_order<buffer_entry>::k_front;
  std::size_t cheapest_per_byte(std::span<std::size_t> out) const noexcept { return by_cost_.cheapest(out); }
  // Places the candidates whose cost changed since the last read in the cost order (cost_order.hpp:
  // placement waits for the next read, so that a key changed many times is placed once).
  void settle_cost_order() const noexcept { by_cost_.settle(); }
  std::size_t cost_order_waiting() const noexcept { return by_cost_.waiting(); }

  std::size_t size() const noexcept { return all_.size(); }
  const candidate_record& at(std::size_t i) const noexcept { return all_[i]; }
  candidate_record& at(std::size_t i) noexcept { return all_[i]; }
  candidate_record& record(const buffer_entry& e) noexcept { return all_[e.candidate_index]; }
  const candidate_record& record(const buffer_entry& e) const noexcept { return all_[e.candidate_index]; }
  buffer_entry* oldest() const noexcept { return lru_.empty() ? nullptr : const_cast<buffer_entry*>(&lru_.front()); }
  buffer_entry* largest() const noexcept { return sizes_.empty() ? nullptr : const_cast<buffer_entry*>(&*sizes_.rbegin()); }

 private:
  std::vector<candidate_record> all_;
  lru_list lru_;
  size_tree sizes_;
  cost_order<buffer_entry> by_cost_;
};

}  // namespace spillway::eviction::detail
