// torch_allocator.cpp: allocation, freeing, budgets and the unsupported features of torch_allocator.
// Statistics and snapshots are in torch_allocator_state.cpp. The contract is in torch_allocator.hpp.
#include "torch_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <shared_mutex>

#include "plugin_backends.hpp"
#include "spillway/errors.hpp"

namespace spillway::torch_plugin {

using c10::CachingDeviceAllocator::TraceEntry;

namespace {

// Every live torch_allocator, for the DataPtr deleter (a plain function: it gets only the pointer).
// The installed one is looked at first, without the lock. These are never destroyed, so that
// allocators and tensors destroyed at exit, in any order, still find them. The deleter holds the
// mutex shared while it frees (a free may run torch's recorder, which takes the GIL: deleters on
// other threads must not wait for it); creation and destruction hold it exclusively.
std::shared_mutex& live_mutex = *new std::shared_mutex;
std::vector<torch_allocator*>& live_allocators = *new std::vector<torch_allocator*>;
std::atomic<torch_allocator*> installed_allocator{nullptr};
// Keeps the installed allocator alive: tensors may outlive everything else.
std::shared_ptr<torch_allocator>& installed_owner = *new std::shared_ptr<torch_allocator>;

}  // namespace

// The deleter of every DataPtr spillway hands out. Never throws: it runs in destructors.
void delete_tensor_memory(void* ptr) noexcept;

torch_context cuda_context() {
  return {[] { return c10::cuda::current_device(); },
          [](c10::DeviceIndex device) {
            return stream_ref{reinterpret_cast<std::uintptr_t>(
                c10::cuda::getCurrentCUDAStream(device).stream())};
          }};
}

torch_allocator::torch_allocator(plugin_config config, torch_context context)
    : config_(std::move(config)),
      context_(std::move(context)),
      devices_(make_plugin_allocator(
          config_,
          {.on_warning = [](const std::string& message) { std::cerr << message << '\n'; },
           .on_free_completed =
               [this](int device, void* ptr, std::size_t requested, stream_ref stream) {
                 history_.record_free_completed(static_cast<c10::DeviceIndex>(device), ptr,
                                                requested, reinterpret_cast<void*>(stream.value));
               },
           .on_segment_change =
               [this](int device, segment_change what, void* address, std::size_t bytes,
                      stream_ref stream) {
                 history_.record_segment(what, static_cast<c10::DeviceIndex>(device), address,
                                         bytes, reinterpret_cast<void*>(stream.value));
               }})),
      oversized_ooms_(std::make_unique<std::atomic<std::int64_t>[]>(
          static_cast<std::size_t>(devices_->device_count()))) {
  std::lock_guard lock(live_mutex);
  live_allocators.push_back(this);
}

torch_allocator::~torch_allocator() {
  std::lock_guard lock(live_mutex);
  live_allocators.erase(std::find(live_allocators.begin(), live_allocators.end(), this));
  torch_allocator* self = this;
  installed_allocator.compare_exchange_strong(self, nullptr);
}

// --- allocation -------------------------------------------------------------------------------

void torch_allocator::checked_index(c10::DeviceIndex device, const char* caller) const {
  TORCH_CHECK_INDEX(device >= 0 && device < devices_->device_count(), "spillway: ", caller,
                    ": device ", static_cast<int>(device), " is out of range: expected 0 to ",
                    devices_->device_count() - 1);
}

device_allocator& torch_allocator::checked_device(c10::DeviceIndex device, const char* caller) {
  checked_index(device, caller);
  return devices_->device(device);
}

void* torch_allocator::allocate_on(c10::DeviceIndex device, size_t nbytes, stream_ref stream) {
  device_allocator& d = checked_device(device, "allocate");
  if (nbytes == 0) return nullptr;
  stream = devices_->stream_of(reinterpret_cast<const void*>(stream.value));  // cudaStreamLegacy
  // The context of the allocation (ALLOC, OOM) and of the segment events it causes, gathered
  // before the device lock, as PyTorch's allocator gathers it.
  allocation_history::context_scope scope(history_, TraceEntry::ALLOC);
  void* ptr = nullptr;
  try {
    ptr = devices_->allocate(device, nbytes, stream);
  } catch (const out_of_memory& e) {
    scope.close();  // what the OOM observers release is not this allocation's doing
    fail_out_of_memory(device, stream, e, scope.context());
  } catch (const invalid_argument& e) {
    scope.close();
    // The only argument left to refuse is the size (the device was checked): over what any
    // device could hold, which PyTorch reports, and counts, as out of memory.
    oversized_ooms_[static_cast<std::size_t>(device)].fetch_add(1, std::memory_order_relaxed);
    fail_out_of_memory(device, stream, out_of_memory(e.what(), oversized_details(d, nbytes)),
                       scope.context());
  }
  try {
    history_.record(TraceEntry::ALLOC, device, reinterpret_cast<std::size_t>(ptr), nbytes,
                    reinterpret_cast<void*>(stream.value), scope.context());
  } catch (...) {
    // The caller gets the error, and nothing is held for nobody. The free is recorded as any
    // free is, so that the trace (which may hold the ALLOC) and the kept contexts stay paired.
    try {
      history_.record(TraceEntry::FREE_REQUESTED, device, reinterpret_cast<std::size_t>(ptr),
                      nbytes, reinterpret_cast<void*>(stream.value), nullptr);
    } catch (...) {
    }
    devices_->deallocate(ptr);
    throw;
  }
  if (c10::memoryProfilingEnabled()) [[unlikely]] {
    try {
      report_to_profiler(d, ptr, static_cast<std::int64_t>(d.describe(ptr).size));
    } catch (...) {  // not live any more: another thread freed it already
    }
  }
  return ptr;
}

void torch_allocator::report_to_profiler(const device_allocator& d, void* ptr,
                                         std::int64_t bytes) noexcept {
  try {
    const memory_stats s = d.stats();
    c10::reportMemoryUsageToProfiler(
        ptr, bytes, static_cast<std::size_t>(s.allocated_bytes[0].current),
        static_cast<std::size_t>(s.reserved_bytes[0].current),
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(d.device())));
  } catch (...) {  // the profiler's record is not worth an allocation or a free
  }
}

// What out of memory reports for a request over what any device could hold: the device as it
// is (free memory, budget, allocated, reserved), as PyTorch reports it.
out_of_memory::details torch_allocator::oversized_details(const device_allocator& d,
                                                         std::size_t nbytes) const {
  out_of_memory::details info;
  info.device = d.device();
  info.requested = info.rounded = nbytes;
  info.budget = d.budget();
  try {
    const memory_stats s = d.stats();
    info.allocated = static_cast<std::size_t>(s.allocated_bytes[0].current);
    info.reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
    info.device_free = d.backend().free_memory();
  } catch (...) {  // the report goes out with what is known
  }
  return info;
}

// What PyTorch's allocator does on out of memory: an OOM trace entry (the device's free bytes
// as its address, the rounded request as its size), the observers told (device, the rounded
// request, the memory it may use: the budget, or the device's memory, and the device's free
// bytes), then c10::OutOfMemoryError. From the error's details alone: no device call here.
void torch_allocator::fail_out_of_memory(c10::DeviceIndex device, stream_ref stream,
                                         const out_of_memory& error,
                                         std::shared_ptr<c10::GatheredContext> context) {
  const out_of_memory::details& d = error.info();
  const std::size_t total = devices_->device(device).backend().total_memory();
  const std::size_t allowed = std::min(d.budget, total);
  try {
    history_.record(TraceEntry::OOM, device, d.device_free, d.rounded,
                    reinterpret_cast<void*>(stream.value), std::move(context));
  } catch (...) {
  }
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
  {
    std::lock_guard lock(observers_mutex_);
    observers = oom_observers_;
  }
  for (const auto& observer : observers) {
    observer(device, d.rounded, allowed, d.device_free);
  }
  if (c10::memoryProfilingEnabled()) [[unlikely]] {
    c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(d.rounded), d.allocated, d.reserved,
                                     c10::Device(c10::DeviceType::CUDA, device));
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. ", error.what());
}

c10::DataPtr torch_allocator::allocate(size_t nbytes) {
  const c10::DeviceIndex device = context_.current_device();
  void* ptr = allocate_on(device, nbytes, context_.current_stream(device));
  return {ptr, ptr, &delete_tensor_memory, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr torch_allocator::raw_deleter() const { return &delete_tensor_memory; }

void* torch_allocator::raw_alloc(size_t nbytes) {
  const c10::DeviceIndex device = context_.current_device();
  return allocate_on(device, nbytes, context_.current_stream(device));
}

void* torch_allocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  return allocate_on(context_.current_device(), nbytes,
                     stream_ref{reinterpret_cast<std::uintptr_t>(stream)});
}

free_result torch_allocator::release(void* ptr) noexcept {
  // With history or trackers, the free request is recorded before the memory can be reused (a
  // new allocation at the same address must not lose its context to this free's record), with
  // the allocation's requested size and stream, as PyTorch's allocator records it; that needs
  // the device first. Without, the free finds it once. FREE_COMPLETED comes from the device
  // allocator when the block may be handed out again (the free observer of the constructor).
  device_allocator* holder = nullptr;
  if (history_.active()) {
    holder = devices_->owner_of(ptr);
    if (holder == nullptr) holder = devices_->holder_of(ptr);
    if (holder == nullptr) return free_result::foreign;
    try {
      const allocation_info info = holder->describe(ptr);  // not live (a double free): no record
      history_.record(TraceEntry::FREE_REQUESTED, static_cast<c10::DeviceIndex>(holder->device()),
                      reinterpret_cast<std::size_t>(ptr), info.requested_size,
                      reinterpret_cast<void*>(info.stream.value));
    } catch (...) {
      // A recorder that fails must not keep the memory: free it anyway.
    }
  }
  if (other_device_use_count_.load(std::memory_order_acquire) > 0) [[unlikely]] {
    if (!order_after_other_devices(ptr)) return free_result::freed;  // kept: see there
  }
  std::int64_t profiled_bytes = 0;  // the block's size, for the profiler (which wants it negative)
  if (c10::memoryProfilingEnabled()) [[unlikely]] {
    if (holder == nullptr) holder = devices_->owner_of(ptr);
    try {
      if (holder != nullptr) profiled_bytes = static_cast<std::int64_t>(holder->describe(ptr).size);
    } catch (...) {  // not live: a double free, reported below
    }
  }
  const free_result result = devices_->deallocate(ptr, &holder);  // a double free is reported there
  if (result == free_result::foreign) return result;
  if (profiled_bytes != 0 && (result == free_result::freed || result == free_result::deferred)) {
    report_to_profiler(*holder, ptr, -profiled_bytes);  // deferred too: no longer allocated
  }
  try {
    if (!enabled_) holder->empty_cache();
  } catch (...) {
  }
  return result;
}

void torch_allocator::raw_delete(void* ptr) {
  if (ptr == nullptr) return;
  const free_result result = release(ptr);
  TORCH_CHECK(result != free_result::foreign, "spillway: raw_delete(", format_pointer(ptr),
              "): not memory of this allocator (invalid device pointer)");
  // As PyTorch's raw_delete: a pointer that is not a live allocation is an error, not a warning.
  TORCH_CHECK(result != free_result::invalid, "spillway: raw_delete(", format_pointer(ptr),
              "): not a live allocation (freed already?): invalid device pointer");
}

void delete_tensor_memory(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (torch_allocator* a = installed_allocator.load();
      a != nullptr && a->release(ptr) != free_result::foreign) {
    return;
  }
  std::shared_lock lock(live_mutex);
  for (torch_allocator* a : live_allocators) {
    if (a->release(ptr) != free_result::foreign) return;
  }
  std::cerr << "spillway: a tensor's deleter was given " << format_pointer(ptr)
            << ", which no spillway allocator holds; nothing was freed\n";
}

void torch_allocator::copy_data(void* dest, const void* src, std::size_t count) const {
  if (config_.backend == "sim") {
    std::memcpy(dest, src, count);  // simulated device memory is host memory
    return;
  }
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

// --- lifecycle and budgets ---------------------------------------------------------------------

void torch_allocator::init(int device_count) {
  TORCH_CHECK(device_count == devices_->device_count(), "spillway: torch sees ", device_count,
              " CUDA devices but spillway's backend ", config_.backend, " has ",
              devices_->device_count());
  initialized_.store(true);
}

bool torch_allocator::initialized() { return initialized_.load(); }

double torch_allocator::getMemoryFraction(c10::DeviceIndex device) {
  device_allocator& d = checked_device(device, "getMemoryFraction");
  const std::size_t budget = d.budget();
  const std::size_t total = d.backend().total_memory();
  return budget >= total ? 1.0 : static_cast<double>(budget) / static_cast<double>(total);
}

// torch's set_per_process_memory_fraction: the fraction of the device's memory becomes the
// budget. As with PyTorch's allocator, any fraction in [0, 1] is taken, below the memory in use
// too: allocations that need more then fail until enough is freed (spillway.set_budget refuses
// such a budget instead). Unlike PyTorch's, the cache above the budget is released at once and
// the pressure handlers asked (the budget caps reserved memory). 0 leaves 1 byte: no new segment.
void torch_allocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK_VALUE(fraction >= 0.0 && fraction <= 1.0, "spillway: memory fraction ", fraction,
                    " is invalid: expected a number in [0, 1]");
  device_allocator& d = checked_device(device, "setMemoryFraction");
  const allocation_history::context_scope scope(history_, TraceEntry::FREE_REQUESTED);
  try {
    d.set_budget(fraction_of_memory(fraction, d.backend().total_memory()), below_live::accept);
  } catch (const invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

void torch_allocator::emptyCache(c10::MempoolId_t mempool_id) {
  const bool default_pool = mempool_id.first == 0 && mempool_id.second == 0;
  TORCH_CHECK_NOT_IMPLEMENTED(default_pool,
                              "spillway: emptyCache of memory pool (", mempool_id.first, ", ",
                              mempool_id.second,
                              "): spillway does not support CUDA graph or torch.cuda.MemPool pools");
  // Its releases carry the context of this call, with RecordContext ALL, as PyTorch's do (else
  // each segment's own).
  const allocation_history::context_scope scope(history_, TraceEntry::FREE_REQUESTED);
  devices_->empty_cache();
}

void torch_allocator::enable(bool value) { enabled_ = value; }
bool torch_allocator::isEnabled() const { return enabled_; }

void torch_allocator::cacheInfo(c10::DeviceIndex device, size_t* largest_block) {
  device_allocator& d = checked_device(device, "cacheInfo");
  // As PyTorch's: the largest of the caller's guess (0: what a new segment could get, which is
  // cudaMemGetInfo's free memory there and the budget's headroom here) and the largest cached
  // block. cuDNN sizes its workspace by it.
  std::size_t largest = *largest_block;
  if (largest == 0) largest = devices_->memory_info_of(device).headroom;
  *largest_block = std::max(largest, d.largest_free_block());
}

void* torch_allocator::getBaseAllocation(void* ptr, size_t* size) {
  device_allocator* owner = devices_->owner_of(ptr);
  TORCH_CHECK(owner != nullptr, "spillway: getBaseAllocation(", format_pointer(ptr),
              "): not a live allocation of spillway");
  const allocation_info info = owner->describe(ptr);
  if (size != nullptr) *size = info.segment_size;
  return info.segment_base;
}

void torch_allocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  // Like PyTorch's allocator: memory it did not allocate (or none) is not its business.
  if (ptr.get() == nullptr || ptr.get_deleter() != &delete_tensor_memory) return;
  device_allocator* owner = devices_->owner_of(ptr.get());
  if (owner == nullptr) return;
  if (config_.backend == "cuda" && stream.device_index() != owner->device()) {
    // A stream of another device: the device allocator knows its own device's streams only
    // (another's default stream would even look like the block's own). Kept here, and ordered
    // at the free (order_after_other_devices).
    std::lock_guard lock(other_device_uses_mutex_);
    auto [it, added] = other_device_uses_.try_emplace(ptr.get());
    if (added) other_device_use_count_.fetch_add(1, std::memory_order_release);
    if (std::find(it->second.begin(), it->second.end(), stream) == it->second.end()) {
      it->second.push_back(stream);
    }
    return;
  }
  owner->record_stream(ptr.get(), devices_->stream_of(stream.stream()));
}

// Before `ptr` is freed: the block's own stream waits for the work queued so far on the streams
// of other devices that used it, so that whatever gets the block next on that stream (the only
// one its pool serves) runs after them, as do a release (which synchronises its device) and an
// unmapping. An event on the other stream and a wait: no host synchronisation; if either cannot
// be made, the host waits for that stream. Returns false when even that failed for some stream:
// the caller then keeps the block (leaked, reported) rather than reuse it early, as the device
// allocator does (Note [Cross-stream frees]).
bool torch_allocator::order_after_other_devices(void* ptr) noexcept {
  std::vector<c10::cuda::CUDAStream> uses;
  try {
    std::lock_guard lock(other_device_uses_mutex_);
    auto it = other_device_uses_.find(ptr);
    if (it == other_device_uses_.end()) return true;
    uses = std::move(it->second);
    other_device_uses_.erase(it);
    other_device_use_count_.fetch_sub(1, std::memory_order_relaxed);
  } catch (...) {
    return false;
  }
  device_allocator* owner = devices_->owner_of(ptr);
  if (owner == nullptr) return true;  // not live (a double free): reported by the free itself
  bool ordered = true;
  cudaStream_t own = nullptr;
  try {
    own = reinterpret_cast<cudaStream_t>(owner->describe(ptr).stream.value);
  } catch (...) {
    return false;
  }
  const auto own_device = static_cast<c10::DeviceIndex>(owner->device());
  for (const c10::cuda::CUDAStream& use : uses) {
    try {
      cudaError_t err = cudaSuccess;
      {
        c10::cuda::CUDAGuard on_use(use.device_index());
        cudaEvent_t done = nullptr;
        err = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
        if (err == cudaSuccess) err = cudaEventRecord(done, use.stream());
        if (err == cudaSuccess) {
          c10::cuda::CUDAGuard on_own(own_device);
          err = cudaStreamWaitEvent(own, done, 0);
        }
        if (done != nullptr) (void)cudaEventDestroy(done);  // on its device; the wait holds it
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          C10_CUDA_CHECK(cudaStreamSynchronize(use.stream()));
        }
      }
    } catch (const std::exception& e) {
      ordered = false;
      std::cerr << "spillway: cannot order the free of " << format_pointer(ptr)
                << " after a stream of cuda:" << static_cast<int>(use.device_index())
                << " that used it (" << e.what() << "); the block is kept rather than reused early\n";
    }
  }
  return ordered;
}

std::pair<size_t, size_t> torch_allocator::getMemoryInfo(c10::DeviceIndex device) {
  checked_device(device, "getMemoryInfo");
  const memory_info info = devices_->memory_info_of(device);
  return {info.free, info.total};
}

// --- history and observers ---------------------------------------------------------------------

bool torch_allocator::isHistoryEnabled() { return history_.enabled(); }

void torch_allocator::recordHistory(bool enabled,
                                    c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                                    size_t alloc_trace_max_entries,
                                    c10::cuda::CUDACachingAllocator::RecordContext when,
                                    bool clear_history, const std::vector<std::string>& skip_actions) {
  history_.configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history,
                     skip_actions);
}

void torch_allocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
  history_.record_annotation(context_.current_device(), md);
}

void torch_allocator::pushCompileContext(std::string& md) {
  history_.push_compile_context(context_.current_device(), md);
}

void torch_allocator::popCompileContext() { history_.pop_compile_context(context_.current_device()); }

void torch_allocator::setUserMetadata(const std::string& metadata) {
  history_.set_user_metadata(context_.current_device(), metadata);
}

std::string torch_allocator::getUserMetadata() {
  return history_.user_metadata(context_.current_device());
}

void torch_allocator::attachOutOfMemoryObserver(
    c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) {
  std::lock_guard lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void torch_allocator::attachAllocatorTraceTracker(
    c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) {
  history_.attach_tracker(std::move(tracker));
}

// --- peers ---------------------------------------------------------------------------------------

void torch_allocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  checked_device(dev, "enablePeerAccess");
  checked_device(dev_to_access, "enablePeerAccess");
  if (config_.backend != "cuda") return;  // one simulated device: nothing to enable
  {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear it
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  // That covers cudaMalloc'd segments; the pages of expandable ones are mapped for their own
  // device only, and each mapping needs the peer too, as PyTorch's addPeerAccess does.
  devices_->device(dev_to_access).backend().grant_vmm_access(dev);
}

cudaError_t torch_allocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                                         size_t count, cudaStream_t stream, bool p2p_enabled) {
  // Without peer access (enablePeerAccess, which grants expandable segments' pages to the peer
  // too) a copy between devices must take the peer path.
  if (p2p_enabled || dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

// --- not supported -------------------------------------------------------------------------------

void torch_allocator::beginAllocateToPool(c10::DeviceIndex, c10::MempoolId_t,
                                          std::function<bool(cudaStream_t)>) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "spillway does not support private memory pools (beginAllocateToPool): "
                              "CUDA graph capture and torch.cuda.MemPool need PyTorch's own allocator");
}

void torch_allocator::endAllocateToPool(c10::DeviceIndex, c10::MempoolId_t) {}  // never begun
void torch_allocator::releasePool(c10::DeviceIndex, c10::MempoolId_t) {}        // never begun

namespace {
[[noreturn]] void no_mem_pools(const char* call) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "spillway does not support private memory pools (", call,
                              "): torch.cuda.MemPool needs PyTorch's own allocator");
}
}  // namespace

int torch_allocator::getPoolUseCount(c10::DeviceIndex, c10::MempoolId_t) {
  no_mem_pools("getPoolUseCount");
}
void torch_allocator::createOrIncrefPool(c10::DeviceIndex, c10::MempoolId_t,
                                         std::shared_ptr<CUDAAllocator>) {
  no_mem_pools("createOrIncrefPool");
}
void torch_allocator::setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) {
  no_mem_pools("setUseOnOOM");
}
void torch_allocator::setNoSplit(c10::DeviceIndex, c10::MempoolId_t) { no_mem_pools("setNoSplit"); }
bool torch_allocator::checkPoolLiveAllocations(c10::DeviceIndex, c10::MempoolId_t,
                                               const std::unordered_set<void*>&) {
  no_mem_pools("checkPoolLiveAllocations");
}

c10::cuda::CUDACachingAllocator::ShareableHandle torch_allocator::shareIpcHandle(void*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "spillway does not support CUDA IPC (shareIpcHandle): sharing CUDA "
                              "tensors between processes needs PyTorch's own allocator");
}

std::shared_ptr<void> torch_allocator::getIpcDevPtr(std::string) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "spillway does not support CUDA IPC (getIpcDevPtr): receiving CUDA "
                              "tensors from another process needs PyTorch's own allocator");
}

std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> torch_allocator::getCheckpointState(
    c10::DeviceIndex, c10::MempoolId_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "spillway does not support memory pool checkpoints (getCheckpointState), "
                              "which CUDA graph trees in torch.compile use");
}

c10::cuda::CUDACachingAllocator::CheckpointDelta torch_allocator::setCheckpointPoolState(
    c10::DeviceIndex, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState>) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "spillway does not support memory pool checkpoints "
                              "(setCheckpointPoolState), which CUDA graph trees in torch.compile use");
}

std::string torch_allocator::name() { return "spillway"; }

// --- installation --------------------------------------------------------------------------------

void install(std::shared_ptr<torch_allocator> allocator) {
  TORCH_CHECK_VALUE(allocator != nullptr,
                    "spillway: install: the allocator is null; expected a torch_allocator to install");
  // torch checks that its current allocator has not been initialised (no CUDA memory yet).
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  // changeCurrentAllocator sets only CUDACachingAllocator's pointer. c10::GetAllocator(kCUDA),
  // which at::getDeviceAllocator (torch.accelerator's memory statistics, empty_cache and memory
  // info) and storages made without a tensor use, would stay PyTorch's own allocator, never
  // initialised.
  c10::SetAllocator(c10::kCUDA, allocator.get());
  std::lock_guard lock(live_mutex);
  installed_allocator.store(allocator.get());
  installed_owner = std::move(allocator);
}

torch_allocator* installed() noexcept { return installed_allocator.load(); }

}  // namespace spillway::torch_plugin
