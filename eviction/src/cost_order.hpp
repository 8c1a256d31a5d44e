// cost_order.hpp (internal): the eviction candidates ordered by what evicting each costs per byte,
// so that the cheapest join every DTR sample (Note [Eviction policies], "Sampling").
//
// Contract
// - Holds records (registry.hpp's Entry) through their cost_hook, keyed by their cost_per_byte
//   (never NaN) and then by id: a strict order, one place per record.
// - insert and reorder only set the key and put the record on a list of records waiting for their
//   place (O(1)); the next read (cheapest, settle) places them in the tree, O(log n) each. A
//   record whose key changes many times between two reads is placed once: the upkeep of DTR's
//   neighbourhood changes the key of every candidate next to a class whenever the class changes,
//   several times per decision, and each placement is a descent of cold tree nodes (on
//   ResNet-1202's replay about a third of the upkeep's time, measured; Note [Eviction policies],
//   "The cheapest per byte join every sample"). erase is O(1) amortised. None allocates.
// - cheapest(out) writes the candidate_index of up to min(out.size(), k_front) records, the
//   cheapest first, and none with an infinite key (a record the order keeps but that is not to
//   join: see cost_per_byte_locked). It is served from a cached prefix of the order, so that a
//   decision reads one short array instead of walking tree nodes that the rest of the step has
//   pushed out of the cache (a walk of 16 cold nodes doubled a decision's time at 10,000
//   candidates, measured).
//   The prefix is repaired as records come and go, and topped up from the tree only where it
//   fell short: after an eviction of the cheapest, one step of the walk.
// - settle() places the waiting records without reading anything: the engine calls it before a
//   decision, so that the placements count as upkeep, not as the decision's time.
// - Invariant: front_ is the first front_.size() records of the tree's order, and a record is
//   either in the tree or waiting (Entry::cost_waiting), never both. So a record in the tree is in
//   front_ exactly when it is not after front_.back(), and whatever changes after that point
//   leaves it alone.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <limits>
#include <span>

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>

namespace spillway::eviction::detail {

// Entry: a record with cost_hook (a boost::intrusive set hook), wait_hook (a list hook),
// cost_waiting (bool), cost_per_byte, id.value and candidate_index (what cheapest() hands out).
template <class Entry>
class cost_order {
 public:
  static constexpr std::size_t k_front = 16;  // the longest prefix cheapest() hands out

  ~cost_order() {
    waiting_.clear();
    tree_.clear();
  }

  void insert(Entry& e, double cost_per_byte) noexcept {
    e.cost_per_byte = cost_per_byte;
    wait(e);
  }
  void erase(Entry& e) noexcept {
    if (e.cost_waiting) {
      waiting_.erase(waiting_.iterator_to(e));
      e.cost_waiting = false;
      return;
    }
    leave_front(e);
    tree_.erase(tree_.iterator_to(e));
  }
  // e's cost per byte changed (its neighbourhood did): it leaves its place and waits for the next.
  void reorder(Entry& e, double cost_per_byte) noexcept {
    if (cost_per_byte == e.cost_per_byte) return;
    if (!e.cost_waiting) {
      leave_front(e);
      tree_.erase(tree_.iterator_to(e));
      wait(e);
    }
    e.cost_per_byte = cost_per_byte;
  }

  // Places every waiting record in the tree (and in the prefix where it belongs).
  void settle() const noexcept {
    while (!waiting_.empty()) {
      Entry& e = waiting_.front();
      waiting_.pop_front();
      e.cost_waiting = false;
      tree_.insert(e);
      enter_front(e);
    }
  }
  std::size_t waiting() const noexcept { return waiting_.size(); }

  std::size_t cheapest(std::span<std::size_t> out) const noexcept {
    settle();
    top_up(std::min(out.size(), k_front));
    const std::size_t n = std::min(out.size(), size_);
    std::size_t k = 0;
    for (; k < n && front_[k]->cost_per_byte != std::numeric_limits<double>::infinity(); ++k) {
      out[k] = front_[k]->candidate_index;
    }
    return k;
  }

 private:
  struct by_key {
    bool operator()(const Entry& a, const Entry& b) const noexcept {
      return a.cost_per_byte != b.cost_per_byte ? a.cost_per_byte < b.cost_per_byte
                                                : a.id.value < b.id.value;
    }
  };
  using tree = boost::intrusive::set<
      Entry,
      boost::intrusive::member_hook<Entry, decltype(Entry::cost_hook), &Entry::cost_hook>,
      boost::intrusive::compare<by_key>>;
  using wait_list = boost::intrusive::list<
      Entry, boost::intrusive::member_hook<Entry, decltype(Entry::wait_hook), &Entry::wait_hook>,
      boost::intrusive::constant_time_size<true>>;

  void wait(Entry& e) noexcept {
    e.cost_waiting = true;
    waiting_.push_back(e);
  }

  // A record placed in the tree: if it lands inside the prefix, the prefix takes it (and drops
  // its last record when full); after the prefix, nothing changes.
  void enter_front(Entry& e) const noexcept {
    if (size_ == 0 || !by_key{}(e, *front_[size_ - 1])) return;  // after the prefix (or none)
    const auto end = front_.begin() + static_cast<std::ptrdiff_t>(size_);
    const auto at = std::upper_bound(front_.begin(), end, &e,
                                     [](const Entry* a, const Entry* b) { return by_key{}(*a, *b); });
    if (size_ == k_front) --size_;  // the last one falls out; top_up finds it again if needed
    const auto last = front_.begin() + static_cast<std::ptrdiff_t>(size_);
    std::copy_backward(at, last, last + 1);
    *at = &e;
    ++size_;
  }
  // A record leaving its place: out of the prefix if it was in it.
  void leave_front(Entry& e) noexcept {
    if (size_ == 0 || by_key{}(*front_[size_ - 1], e)) return;  // after the prefix
    const auto end = front_.begin() + static_cast<std::ptrdiff_t>(size_);
    const auto at = std::find(front_.begin(), end, &e);
    if (at == end) return;  // cannot happen while the invariant holds
    std::copy(at + 1, end, at);
    --size_;
  }
  // Extends the prefix from the tree to `want` records (or all there are).
  void top_up(std::size_t want) const noexcept {
    if (size_ >= want) return;
    auto it = size_ == 0 ? tree_.begin() : std::next(tree_.iterator_to(*front_[size_ - 1]));
    for (; size_ < want && it != tree_.end(); ++it) front_[size_++] = const_cast<Entry*>(&*it);
  }

  // Placing waiting records is part of reading: settle() and cheapest() are const to their users.
  mutable tree tree_;
  mutable wait_list waiting_;
  mutable std::array<Entry*, k_front> front_{};  // a cache: see the invariant above
  mutable std::size_t size_ = 0;
};

}  // namespace spillway::eviction::detail
