// block_pool.hpp (internal): the free blocks of one pool, the record arenas, and the live table.
//
// - block_pool: the free tree of the small or the large pool. insert/erase keep the
//   inactive_split statistics in step with the tree: a free block that does not span its whole
//   segment is an "inactive split" block (PyTorch's definition). An allocation or a free that
//   changes the tree several times gathers those changes in a split_delta and applies the net
//   once, as PyTorch changes them once per allocation and per free: the current values are the
//   same either way, the cumulative allocated and freed counts agree with PyTorch's only so.
//   They also keep releasable(): what
//   giving the free blocks back would return to the device (a block that is its whole fixed
//   segment, the whole granules of a block of an expandable one), so that the pressure path knows
//   it in O(1) instead of walking every segment (and every block of the expandable ones). Exact
//   because a free block's address, size and segment change only while it is out of the tree.
// - record_arena<T>: recycles block and segment records through a free list, so that splitting
//   and coalescing never call malloc on the allocation path.
// - live_blocks: the live table plus the bucket array it needs; grows by doubling (a rehash is
//   amortised O(1) and happens only while the number of live blocks reaches a new high).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "block.hpp"
#include "spillway/allocator_config.hpp"
#include "spillway/size_classes.hpp"
#include "spillway/stats.hpp"

namespace spillway::detail {

class block_pool {
 public:
  block_pool(bool small, memory_stats& stats) : small_(small), stats_(stats) {}
  ~block_pool() { tree_.clear(); }

  bool small() const noexcept { return small_; }

  // The smallest free block on `stream` of at least `size` bytes, lowest address first on ties;
  // nullptr when there is none, or when that block is oversize and may not serve `size` (then
  // no larger one may either). O(log n).
  block* best_fit(stream_ref stream, std::size_t size) noexcept {
    auto it = tree_.lower_bound(fit_key{stream, size}, fit_key_order{});
    if (it == tree_.end() || it->stream != stream) return nullptr;
    if (it->size >= max_split_size_ && !oversize_serves(it->size, size)) return nullptr;
    return &*it;
  }

  // best_fit among the free blocks of segments that hold live blocks, outside segment
  // `outside`: compaction packs live blocks into holes of segments in use, never into one that
  // has none (free as a whole, or only frees pending on events: one it may just have emptied,
  // better given back) nor the one it is emptying. O(log n) plus the blocks skipped.
  block* best_fit_in_use(stream_ref stream, std::size_t size, const segment* outside) noexcept {
    auto it = tree_.lower_bound(fit_key{stream, size}, fit_key_order{});
    while (it != tree_.end() && it->stream == stream && (it->seg == outside || it->seg->live_blocks == 0)) ++it;
    if (it == tree_.end() || it->stream != stream) return nullptr;
    if (it->size >= max_split_size_ && !oversize_serves(it->size, size)) return nullptr;
    return &*it;
  }
  // Blocks of at least `bytes` are oversize (no_split_limit: none). The large pool's only.
  void set_max_split_size(std::size_t bytes) noexcept { max_split_size_ = bytes; }
  std::size_t max_split_size() const noexcept { return max_split_size_; }

  void insert(block* b) noexcept;
  void erase(block* b) noexcept;
  // The same, their inactive_split change gathered in `net` for one apply() (see the top of the
  // file): an allocation's or a free's several tree changes count once, as PyTorch's do.
  struct split_delta {
    std::int64_t blocks = 0, bytes = 0;
  };
  void insert(block* b, split_delta& net) noexcept {
    tree_.insert(*b);
    releasable_ += releasable_of(b);
    count(b, +1, net);
  }
  void erase(block* b, split_delta& net) noexcept {
    tree_.erase(tree_.iterator_to(*b));
    releasable_ -= releasable_of(b);
    count(b, -1, net);
  }
  void apply(const split_delta& net) noexcept {
    if (net.blocks != 0 || net.bytes != 0) apply_nonzero(net);
  }

  // Expandable segments' granule (0: none); set before the first block enters the pool.
  void set_granularity(std::size_t bytes) noexcept { granularity_ = bytes; }
  // What releasing every free block of the pool would give back to the device now.
  std::size_t releasable() const noexcept { return releasable_; }
  // What releasing free block b alone would give back: its segment if b is all of it (fixed
  // segments), or the whole granules inside it (expandable ones).
  std::size_t releasable_of(const block* b) const noexcept;

  free_tree& tree() noexcept { return tree_; }
  const free_tree& tree() const noexcept { return tree_; }

 private:
  stat_type type() const noexcept { return small_ ? stat_type::small_pool : stat_type::large_pool; }
  // PyTorch's inactive_split: a free piece of a split segment; expandable segments do not count.
  static void count(const block* b, int sign, split_delta& net) noexcept {
    if (!b->is_split() || b->seg->expandable) return;
    net.blocks += sign;
    net.bytes += sign * static_cast<std::int64_t>(b->size);
  }
  void apply_nonzero(const split_delta& net) noexcept;
  // Note [Oversize blocks]: which requests an oversize block may serve, whole.
  // At or above the limit, a block less than 20 MiB larger; below it, only a block less than the
  // segment rounding larger: the segment such a request gets of its own when that rounding takes
  // it to the limit (a 63 MiB request under a 64 MiB limit), which must serve it again.
  bool oversize_serves(std::size_t block_size, std::size_t size) const noexcept {
    const std::size_t waste = block_size - size;
    return size >= max_split_size_ ? waste < size_classes::large_segment_size
                                   : waste < size_classes::segment_rounding;
  }

  bool small_;
  memory_stats& stats_;
  free_tree tree_;
  std::size_t max_split_size_ = no_split_limit;
  std::size_t granularity_ = 0;
  std::size_t releasable_ = 0;  // releasable_of summed over the tree
};

template <class T>
class record_arena {
 public:
  record_arena() = default;
  record_arena(const record_arena&) = delete;
  record_arena& operator=(const record_arena&) = delete;

  T* make() {
    if (free_.empty()) {
      owned_.push_back(std::make_unique<T>());
      free_.reserve(owned_.size());  // so that recycle() never allocates
      return owned_.back().get();
    }
    T* t = free_.back();
    free_.pop_back();
    return t;
  }
  void recycle(T* t) noexcept {
    *t = T{};             // hooks must be unlinked by the caller; this resets the fields
    free_.push_back(t);   // capacity was reserved when t was made: no allocation here
  }

 private:
  std::vector<std::unique_ptr<T>> owned_;
  std::vector<T*> free_;
};

class live_blocks {
 public:
  live_blocks() : buckets_(initial_buckets), table_(live_table::bucket_traits(buckets_.data(), buckets_.size())) {}
  ~live_blocks() { table_.clear(); }

  block* find(std::uintptr_t address) noexcept {
    auto it = table_.find(address, block_address_hash{}, block_address_equal{});
    return it == table_.end() ? nullptr : &*it;
  }
  const block* find(std::uintptr_t address) const noexcept {
    auto it = table_.find(address, block_address_hash{}, block_address_equal{});
    return it == table_.end() ? nullptr : &*it;
  }
  // Makes room for one more block; the only step that can throw (std::bad_alloc).
  void reserve_one() {
    if (table_.size() >= buckets_.size()) [[unlikely]] grow();
  }
  void insert(block* b) noexcept { table_.insert(*b); }  // after reserve_one()
  void erase(block* b) noexcept { table_.erase(table_.iterator_to(*b)); }
  std::size_t size() const noexcept { return table_.size(); }
  void clear() noexcept { table_.clear(); }
  template <class F>
  void for_each(F&& f) const {
    for (const block& b : table_) f(b);
  }

 private:
  static constexpr std::size_t initial_buckets = 1024;
  void grow();

  std::vector<live_table::bucket_type> buckets_;
  live_table table_;
};

}  // namespace spillway::detail
