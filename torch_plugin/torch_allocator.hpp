// torch_allocator: spillway as PyTorch's CUDA allocator, the whole
// c10::cuda::CUDACachingAllocator::CUDAAllocator interface of the torch it is built against (2.11).
//
// Contract
// - One torch_allocator serves every device through a plugin_allocator (plugin_allocator.hpp): one
//   spillway device_allocator per device, created on first use, with the budget SPILLWAY_CONF (or
//   spillway.install) gives it. install() makes it both c10's CUDA allocator (c10::SetAllocator)
//   and the CUDACachingAllocator pointer, through torch's own changeCurrentAllocator; it must run
//   before CUDA memory is first allocated, and the object then lives until the process ends.
// - allocate(n) serves the current device on its current stream (the torch_context, below);
//   raw_alloc / raw_alloc_with_stream / raw_delete are the same without a DataPtr. Size 0 gives a
//   null pointer, as PyTorch's allocator does.
// - Out of memory, after spillway's whole pressure path (eviction included), and a request over
//   what any device could hold, record an OOM trace entry, call every OOM observer (with the
//   rounded request, the budget and the device's free memory, as PyTorch does) and throw
//   c10::OutOfMemoryError (torch.cuda.OutOfMemoryError in Python) carrying spillway's message:
//   request, budget, allocated, reserved, largest free block, pinned bytes.
// - Statistics, snapshot, empty_cache, the memory fraction (a budget of fraction x device memory,
//   taken below the memory in use as PyTorch takes it), cacheInfo (the larger of the budget's
//   headroom and the largest cached block), getBaseAllocation, recordStream, memory history
//   (allocations; free requests and completions, a completion when the block may be handed out
//   again, with the allocation's requested size and stream; segments reserved, released, mapped
//   and unmapped; the contexts torch's recorder gathers, outside any lock; compile contexts,
//   user metadata and annotations) and trace trackers
//   map one to one onto the allocator's. recordStream with a stream of another device (which
//   the device allocator cannot order after) makes the block's own stream wait for that stream's
//   work at the free: an event and a stream wait, not a host synchronisation.
//   A request over what any device could hold counts in
//   num_ooms, as in PyTorch.
//   getMemoryInfo reports what cudaMemGetInfo reports under spillway: total = the budget.
//   While torch's profiler records memory (profile_memory, the memory timeline), every
//   allocation, free and out of memory is reported to it with the device's allocated and
//   reserved bytes, as PyTorch's allocator reports them (the block's rounded size).
// - Not supported, each failing with a NotImplementedError that names the feature: CUDA graph
//   private pools (beginAllocateToPool, setCheckpointPoolState, torch.cuda.MemPool) and CUDA IPC
//   (shareIpcHandle / getIpcDevPtr). releasePool and endAllocateToPool for a pool that was never
//   begun are no-ops, so that torch's cleanup paths do not throw.
// - Thread-safe: the device allocators lock per device; the history and observers have their own
//   mutex.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "plugin_allocator.hpp"
#include "spillway/errors.hpp"
#include "torch_allocator_history.hpp"

namespace spillway::torch_plugin {

// Where allocate() finds "the current device and stream". In a process that uses CUDA it is
// c10::cuda's (cuda_context()); tests on the simulated device pass their own.
struct torch_context {
  std::function<c10::DeviceIndex()> current_device;
  std::function<stream_ref(c10::DeviceIndex)> current_stream;
};
torch_context cuda_context();

class torch_allocator final : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  torch_allocator(plugin_config config, torch_context context);
  ~torch_allocator() override;

  plugin_allocator& devices() noexcept { return *devices_; }
  device_allocator& device(c10::DeviceIndex index) { return devices_->device(index); }
  const plugin_config& config() const noexcept { return config_; }
  // The statistics of `device` (created if need be), as torch.cuda.memory_stats() reports them:
  // num_ooms counts the requests over what any device could hold as well, which the device
  // allocator refuses as invalid_argument and this allocator reports as out of memory.
  // An index out of range is invalid_argument naming it.
  memory_stats device_stats(int index);

  // Frees `ptr` if this allocator holds it (a double free is reported, nothing changes: invalid);
  // foreign when the memory is not this allocator's. For the DataPtr deleter and raw_delete.
  free_result release(void* ptr) noexcept;

  // Memory of `device` on `stream`, as allocate() gives it without a DataPtr (size 0: nullptr);
  // out of memory is c10::OutOfMemoryError after the OOM observers ran. For allocators of other
  // device types over this one (sim_cpu_tensors.hpp).
  void* allocate_on(c10::DeviceIndex device, size_t nbytes, stream_ref stream);

  // --- c10::Allocator ---------------------------------------------------------------------------
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // --- c10::DeviceAllocator ---------------------------------------------------------------------
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

  // --- CUDAAllocator ----------------------------------------------------------------------------
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  using CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0},
                                                         bool include_traces = true) override;
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  // torch.cuda.MemPool's calls: NotImplementedError naming each, as beginAllocateToPool's.
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<CUDAAllocator> allocator) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries,
                     c10::cuda::CUDACachingAllocator::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override;
  // Of the current device, as PyTorch's allocator keeps them (torch_allocator_history.hpp).
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, c10::MempoolId_t id) override;
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override;
  std::string name() override;

 private:
  [[noreturn]] void fail_out_of_memory(c10::DeviceIndex device, stream_ref stream,
                                       const out_of_memory& error,
                                       std::shared_ptr<c10::GatheredContext> context);
  out_of_memory::details oversized_details(const device_allocator& d, std::size_t nbytes) const;
  // To torch's profiler, when it records memory: `bytes` (negative for a free) at ptr, with the
  // device's allocated and reserved bytes now.
  static void report_to_profiler(const device_allocator& d, void* ptr, std::int64_t bytes) noexcept;
  bool order_after_other_devices(void* ptr) noexcept;
  // snapshot(): one device's segments, then its SNAPSHOT history entry.
  void append_segments(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                       std::vector<c10::cuda::CUDACachingAllocator::SegmentInfo>& segments);
  void checked_index(c10::DeviceIndex device, const char* caller) const;
  device_allocator& checked_device(c10::DeviceIndex device, const char* caller);

  plugin_config config_;
  torch_context context_;
  allocation_history history_;  // before devices_: their frees are recorded until they are gone
  std::unique_ptr<plugin_allocator> devices_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::mutex observers_mutex_;
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> oom_observers_;
  // Per device: requests refused as too large, reported as out of memory (device_stats).
  std::unique_ptr<std::atomic<std::int64_t>[]> oversized_ooms_;
  // recordStream's streams of other devices than the block's, by pointer, until its free.
  std::mutex other_device_uses_mutex_;
  std::unordered_map<const void*, std::vector<c10::cuda::CUDAStream>> other_device_uses_;
  std::atomic<std::size_t> other_device_use_count_{0};  // entries: a free looks only when some
};

// Installs `allocator` as PyTorch's CUDA allocator (see the contract). Throws c10::Error when
// torch's allocator is already in use. The allocator must outlive every tensor it serves.
void install(std::shared_ptr<torch_allocator> allocator);

// The torch_allocator install() installed, or nullptr.
torch_allocator* installed() noexcept;

}  // namespace spillway::torch_plugin
