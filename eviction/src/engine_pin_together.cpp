// engine_pin_together.cpp: pinning several buffers together — pin_all, and the inputs of a
// recompute — so that bringing one back never evicts another, and letting those pins go once when
// that is what keeps one from fitting: Note [Pinning together lets go to fit] in docs/eviction.md.
#include <algorithm>
#include <span>
#include <vector>

#include "engine_impl.hpp"
#include "spillway/errors.hpp"

namespace spillway::eviction {

using detail::buffer_entry;

std::vector<pinned_buffer> eviction_engine::pin_all(std::span<const buffer_id> ids) {
  impl& m = *impl_;
  std::vector<buffer_entry*> entries;
  entries.reserve(ids.size());
  std::vector<pinned_buffer> pins;
  pins.reserve(ids.size());
  engine_lock lock(m);
  for (buffer_id id : ids) entries.push_back(&m.lookup_locked(id, "pin_all"));  // throws first
  m.note_access_locked(entries);
  m.pin_together_locked(entries, 0);
  // No pinned_buffer is made before every pin is taken: destroying one takes the engine lock.
  for (buffer_entry* e : entries) pins.push_back(pinned_buffer(this, e->id, e->device_ptr, e->size));
  return pins;
}

namespace {
// Marks the entries of a pin_together that has let its pins go as wanted now, for as long as it
// runs (Note [Pinning together lets go to fit]); an entry marked by an enclosing call stays marked.
// `count` is the engine's number of marked entries.
class wanted_now_marks {
 public:
  explicit wanted_now_marks(std::size_t& count) noexcept : count_(count) {}
  wanted_now_marks(const wanted_now_marks&) = delete;
  wanted_now_marks& operator=(const wanted_now_marks&) = delete;
  ~wanted_now_marks() {
    for (buffer_entry* e : marked_) e->wanted_now = false;
    count_ -= marked_.size();
  }
  void mark(std::span<buffer_entry* const> entries) {
    marked_.reserve(marked_.size() + entries.size());
    for (buffer_entry* e : entries) {
      if (e->wanted_now) continue;
      e->wanted_now = true;
      marked_.push_back(e);
      ++count_;
    }
  }

 private:
  std::size_t& count_;
  std::vector<buffer_entry*> marked_;
};
}  // namespace

// Pins every entry (repeats pin more than once): the usable ones first, then the others, each made
// resident and pinned in turn, so that making one resident never evicts another. If making one
// resident runs out of memory while pins taken here hold others, those pins are let go and the
// entries are taken once more, the one that failed first, each marked as wanted now while they
// are: Note [Pinning together lets go to fit]. On an exception the pins taken here are released.
void eviction_engine::impl::pin_together_locked(std::span<buffer_entry* const> entries,
                                                std::size_t depth) {
  reap_in_flight_locked();
  std::vector<buffer_entry*> order(entries.begin(), entries.end());
  std::stable_partition(order.begin(), order.end(), [](const buffer_entry* e) {
    return e->state == buffer_state::resident || e->state == buffer_state::restoring;
  });
  std::size_t pinned = 0;  // entries [0, pinned) of `order` hold a pin taken here
  const auto release = [&] {
    while (pinned > 0) unpin_locked(*order[--pinned]);
  };
  wanted_now_marks wanted(wanted_now_entries);
  for (bool retried = false;; retried = true) {
    try {
      for (; pinned < order.size(); ++pinned) {
        make_resident_locked(*order[pinned], depth);
        pin_locked(*order[pinned]);
      }
      return;
    } catch (const out_of_memory&) {
      // The thrashing bound's too: another order may still finish under it (every node a retry
      // runs is checked against it).
      const auto failed = static_cast<std::ptrdiff_t>(pinned);
      release();
      if (retried || failed == 0) throw;
      // The pins held here may be what keeps order[failed] from fitting: with them let go they
      // can be evicted while it is made resident; take it first this time.
      std::rotate(order.begin(), order.begin() + failed, order.begin() + failed + 1);
      wanted.mark(order);  // before any of them is described to the policy as a candidate
      ++stats.pin_holds_released;
    } catch (...) {
      release();
      throw;
    }
  }
}

}  // namespace spillway::eviction
