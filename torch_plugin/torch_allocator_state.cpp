// torch_allocator_state.cpp: torch_allocator's statistics and snapshots, in c10's types.
// spillway's memory_stats and memory_snapshot are field for field PyTorch's (stats.hpp,
// snapshot.hpp), so these are copies; the contract is in torch_allocator.hpp.
#include <algorithm>
#include <cstddef>

#include "torch_allocator.hpp"

namespace spillway::torch_plugin {

namespace cca = c10::cuda::CUDACachingAllocator;

namespace {

c10::CachingAllocator::StatArray to_c10(const stat_array& from) {
  c10::CachingAllocator::StatArray to;
  for (int i = 0; i < stat_type_count; ++i) {
    to[i].current = from[i].current;
    to[i].peak = from[i].peak;
    to[i].allocated = from[i].allocated;
    to[i].freed = from[i].freed;
  }
  return to;
}

c10::CachingAllocator::Stat to_c10(const stat& from) {
  c10::CachingAllocator::Stat to;
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
  return to;
}

}  // namespace

c10::CachingDeviceAllocator::DeviceStats torch_allocator::getDeviceStats(c10::DeviceIndex device) {
  checked_index(device, "getDeviceStats");
  c10::CachingDeviceAllocator::DeviceStats out;
  // A device spillway has not used yet has all-zero statistics; asking does not create it.
  if (devices_->created_device(device) == nullptr) return out;
  const memory_stats s = device_stats(device);
  out.allocation = to_c10(s.allocation);
  out.segment = to_c10(s.segment);
  out.active = to_c10(s.active);
  out.inactive_split = to_c10(s.inactive_split);
  out.allocated_bytes = to_c10(s.allocated_bytes);
  out.reserved_bytes = to_c10(s.reserved_bytes);
  out.active_bytes = to_c10(s.active_bytes);
  out.inactive_split_bytes = to_c10(s.inactive_split_bytes);
  out.requested_bytes = to_c10(s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.oversize_allocations = to_c10(s.oversize_allocations);
  out.oversize_segments = to_c10(s.oversize_segments);
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = s.max_split_size;
  return out;
}

memory_stats torch_allocator::device_stats(int device) {
  memory_stats s = devices_->device(device).stats();  // invalid_argument names a bad index
  s.num_ooms += oversized_ooms_[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  return s;
}

void torch_allocator::resetAccumulatedStats(c10::DeviceIndex device) {
  checked_index(device, "resetAccumulatedStats");
  if (device_allocator* d = devices_->created_device(device)) d->reset_accumulated_stats();
  oversized_ooms_[static_cast<std::size_t>(device)].store(0, std::memory_order_relaxed);
}

void torch_allocator::resetPeakStats(c10::DeviceIndex device) {
  checked_index(device, "resetPeakStats");
  if (device_allocator* d = devices_->created_device(device)) d->reset_peak_stats();
}

std::vector<cca::StreamSegmentSize> torch_allocator::getExpandableSegmentSizes(
    c10::DeviceIndex device) {
  checked_index(device, "getExpandableSegmentSizes");
  std::vector<cca::StreamSegmentSize> sizes;
  const device_allocator* d = devices_->created_device(device);
  if (d == nullptr) return sizes;
  // One entry per (stream, pool), as PyTorch has one expandable segment for each: the snapshot
  // lists each mapped run of it (runs apart once empty_cache unmapped the middle) on its own.
  for (const segment_info& seg : d->snapshot().segments) {
    if (!seg.is_expandable) continue;
    const auto stream = reinterpret_cast<cudaStream_t>(seg.stream.value);
    auto same = std::find_if(sizes.begin(), sizes.end(), [&](const cca::StreamSegmentSize& s) {
      return s.stream == stream && s.is_small_pool == !seg.is_large;
    });
    if (same == sizes.end()) {
      sizes.emplace_back(stream, !seg.is_large, seg.total_size);
    } else {
      same->total_size += seg.total_size;
    }
  }
  return sizes;
}

cca::SnapshotInfo torch_allocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  cca::SnapshotInfo out;
  const int count = devices_->device_count();
  if (include_traces) out.device_traces.resize(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    const auto device = static_cast<c10::DeviceIndex>(i);
    if (include_traces) out.device_traces[static_cast<std::size_t>(i)] = history_.entries(device);
    append_segments(device, mempool_id, out.segments);
  }
  if (include_traces) out.external_annotations = history_.annotations();
  cca::AllocatorConfigInfo& cfg = out.config_metadata;
  cfg.garbage_collection_threshold = 0.0;
  cfg.max_split_size = config_.allocator.max_split_size;  // no_split_limit is SIZE_MAX, as PyTorch's
  cfg.pinned_num_register_threads = 1;
  cfg.expandable_segments = config_.allocator.expandable_segments;
  cfg.release_lock_on_malloc = false;
  cfg.pinned_use_host_register = false;
  cfg.graph_capture_record_stream_reuse = false;
  cfg.last_allocator_settings = "spillway";
  return out;
}

// One device's segments in the snapshot, then, as PyTorch's allocator does, a SNAPSHOT entry in
// its history (after its traces were read: the next snapshot's trace has it) whose size is the
// active bytes listed, so that a viewer can place each snapshot among the events.
void torch_allocator::append_segments(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                      std::vector<cca::SegmentInfo>& segments) {
  std::size_t total_active = 0;
  const device_allocator* d = devices_->created_device(device);
  // spillway has no private pools: a snapshot of one (a CUDA graph's) is empty.
  if (d != nullptr && mempool_id.first == 0 && mempool_id.second == 0) {
    for (const segment_info& seg : d->snapshot().segments) {
      c10::CachingDeviceAllocator::SegmentInfo s;
      s.device = device;
      s.address = seg.address;
      s.total_size = seg.total_size;
      s.requested_size = seg.requested_size;
      s.allocated_size = seg.allocated_size;
      s.active_size = seg.active_size;
      s.stream = reinterpret_cast<void*>(seg.stream.value);
      s.is_large = seg.is_large;
      s.is_expandable = seg.is_expandable;
      if (!seg.is_expandable) {  // its SEGMENT_ALLOC's, while history keeps contexts
        s.context_when_allocated = history_.segment_context(reinterpret_cast<const void*>(seg.address));
      }
      s.blocks.reserve(seg.blocks.size());
      for (const block_info& blk : seg.blocks) {
        c10::CachingDeviceAllocator::BlockInfo b;
        b.size = blk.size;
        b.requested_size = blk.requested_size;
        b.allocated = blk.allocated();
        b.active = blk.active();
        if (blk.allocated()) {
          b.context_when_allocated = history_.context_of(reinterpret_cast<const void*>(blk.address));
        }
        s.blocks.push_back(std::move(b));
      }
      total_active += s.active_size;
      segments.push_back(std::move(s));
    }
  }
  history_.record(cca::TraceEntry::SNAPSHOT, device, 0, total_active, nullptr, nullptr);
}

}  // namespace spillway::torch_plugin
