// block_pool.cpp: free-tree insertion with its statistics, and live-table growth.
#include "block_pool.hpp"

namespace spillway::detail {

std::size_t block_pool::releasable_of(const block* b) const noexcept {
  if (!b->seg->expandable) return b->size == b->seg->size ? b->size : 0;
  if (granularity_ == 0) return 0;
  return whole_granules(b->address, b->address + b->size, granularity_).second;
}

void block_pool::insert(block* b) noexcept {
  split_delta net;
  insert(b, net);
  apply(net);
}

void block_pool::erase(block* b) noexcept {
  split_delta net;
  erase(b, net);
  apply(net);
}

// The count and the bytes each move by their own sign, as PyTorch moves them.
void block_pool::apply_nonzero(const split_delta& net) noexcept {
  for (stat_type t : {stat_type::aggregate, type()}) {
    stat& count = stats_.inactive_split[static_cast<int>(t)];
    stat& size = stats_.inactive_split_bytes[static_cast<int>(t)];
    if (net.blocks > 0) count.increase(net.blocks);
    if (net.blocks < 0) count.decrease(-net.blocks);
    if (net.bytes > 0) size.increase(net.bytes);
    if (net.bytes < 0) size.decrease(-net.bytes);
  }
}

void live_blocks::grow() {
  std::vector<live_table::bucket_type> bigger(buckets_.size() * 2);
  table_.rehash(live_table::bucket_traits(bigger.data(), bigger.size()));
  buckets_.swap(bigger);
}

}  // namespace spillway::detail
