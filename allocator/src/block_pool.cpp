// block_pool.cpp: free-tree insertion with its statistics, and live-table growth.
#include "block_pool.hpp"

namespace spillway::detail {

namespace {
// PyTorch's inactive_split: a free piece of a split segment; expandable segments do not count.
bool counts_as_inactive_split(const block* b) noexcept {
  return b->is_split() && !b->seg->expandable;
}
}  // namespace

std::size_t block_pool::releasable_of(const block* b) const noexcept {
  if (!b->seg->expandable) return b->size == b->seg->size ? b->size : 0;
  if (granularity_ == 0) return 0;
  return whole_granules(b->address, b->address + b->size, granularity_).second;
}

void block_pool::insert(block* b) noexcept {
  tree_.insert(*b);
  releasable_ += releasable_of(b);
  if (counts_as_inactive_split(b)) count_split(1, static_cast<std::int64_t>(b->size));
}

void block_pool::erase(block* b) noexcept {
  tree_.erase(tree_.iterator_to(*b));
  releasable_ -= releasable_of(b);
  if (counts_as_inactive_split(b)) count_split(-1, -static_cast<std::int64_t>(b->size));
}

void block_pool::count_split(std::int64_t blocks, std::int64_t bytes) noexcept {
  if (batching_) {
    net_blocks_ += blocks;
    net_bytes_ += bytes;
  } else {
    change_split_stats(blocks, bytes);
  }
}

// The count and the bytes each move by their own sign, as PyTorch moves them.
void block_pool::change_split_stats(std::int64_t blocks, std::int64_t bytes) noexcept {
  for (stat_type t : {stat_type::aggregate, type()}) {
    stat& count = stats_.inactive_split[static_cast<int>(t)];
    stat& size = stats_.inactive_split_bytes[static_cast<int>(t)];
    if (blocks > 0) count.increase(blocks);
    if (blocks < 0) count.decrease(-blocks);
    if (bytes > 0) size.increase(bytes);
    if (bytes < 0) size.decrease(-bytes);
  }
}

void live_blocks::grow() {
  std::vector<live_table::bucket_type> bigger(buckets_.size() * 2);
  table_.rehash(live_table::bucket_traits(bigger.data(), bigger.size()));
  buckets_.swap(bigger);
}

}  // namespace spillway::detail
