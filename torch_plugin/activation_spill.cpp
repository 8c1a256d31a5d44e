// activation_spill.cpp: spilled bytes' copies out to host memory and back (for CUDA on dedicated
// copy streams, in stream order), and prefetch. Contract: activation_manager.hpp.
#include <ATen/EmptyTensor.h>
#include <ATen/Functions.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "activation_manager_impl.hpp"

namespace spillway::torch_plugin {

using detail::byte_view;
using detail::now_seconds;

at::Tensor detail::byte_view(const c10::Storage& storage, std::size_t nbytes) {
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()))
      .set_(storage, 0, {static_cast<int64_t>(nbytes)}, {1});
}

namespace {

std::pair<c10::cuda::CUDAStream, c10::cuda::CUDAStream> copy_streams(c10::DeviceIndex device) {
  // One device-to-host and one host-to-device stream per device, for the process.
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, std::pair<c10::cuda::CUDAStream, c10::cuda::CUDAStream>> streams;
  std::lock_guard lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, std::pair{c10::cuda::getStreamFromPool(false, device),
                                           c10::cuda::getStreamFromPool(false, device)}).first;
  }
  return it->second;
}

// Host memory for spilled bytes: pinned for a CUDA storage (its copies run on a copy engine,
// asynchronously), else `allocator`'s or torch's default CPU allocator's, never the CPU allocator
// installed: that may be spillway's simulated device (sim_cpu_tensors.hpp), the memory a spill frees.
at::Tensor host_bytes(std::size_t nbytes, bool pinned, c10::Allocator* allocator) {
  const std::vector<int64_t> size{static_cast<int64_t>(nbytes)};
  if (pinned) return at::empty(size, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  return at::detail::empty_generic(size, allocator != nullptr ? allocator : c10::GetDefaultCPUAllocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), at::kByte,
                                   std::nullopt);
}

// `waiter` waits for the work queued on `stream` so far; returns the event it waits for.
c10::Event wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& stream) {
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(stream.unwrap());
  waiter.unwrap().wait(ready);
  return ready;
}

// An event that can be timed (PyTorch's default disables timing), recorded on `stream` now.
c10::Event timing_event(const c10::cuda::CUDAStream& stream) {
  c10::Event event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  event.record(stream.unwrap());
  return event;
}

// Seconds on the host clock since `start`: a CPU copy's time (it is synchronous).
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// What the copies of the link tell (activation_link.hpp, scan_copies): CUDA device indices are
// within the estimates' range, so no two devices share a slot.
static_assert(std::numeric_limits<c10::DeviceIndex>::max() < link_estimates::max_devices);

void activation_manager::note_copies() noexcept { scan_copies(timed_copies_, link_); }

// A CPU storage's copy: synchronous, timed on the host clock.
void activation_manager::copy_on_host(const at::Tensor& to, const at::Tensor& from,
                                      link_direction d) {
  const auto start = std::chrono::steady_clock::now();
  to.copy_(from);
  link_.sample(-1, d, static_cast<std::size_t>(to.nbytes()), seconds_since(start));
  used_link(-1);
}

// Room for one more timed copy of `device`, made before the copy is queued: listing it after
// (list_copy) allocates nothing.
void activation_manager::room_for_copy(c10::DeviceIndex device) {
  link_.reserve_device(device);
  if (timed_copies_.size() == timed_copies_.capacity()) {
    timed_copies_.reserve(2 * timed_copies_.size() + 8);
  }
}

void activation_manager::list_copy(timed_copy copy) noexcept {
  const c10::DeviceIndex device = copy.device;
  if (copy.direction == link_direction::to_host) link_.copy_queued(device, copy.bytes);
  timed_copies_.push_back(std::move(copy));  // within room_for_copy's room
  used_link(device);
}

bool activation_manager::room_for_spill(std::size_t nbytes) {
  if (!options_.max_spilled) return true;
  const std::size_t cap = *options_.max_spilled;
  if (spilled_bytes_ + nbytes > cap) return false;  // not even without the kept copies: keep them
  if (const std::size_t total = spilled_bytes_ + kept_host_bytes_ + nbytes; total > cap) {
    let_go_of_kept(total - cap);
  }
  return true;
}

// A kept copy is worth one copy out, if its storage is evicted again before its unpack. Backward
// unpacks in reverse pack order, so the storages packed last are unpacked soonest, the least
// likely to be evicted first: theirs go first. A scan per copy let go; it runs only when host
// memory is short.
void activation_manager::let_go_of_kept(std::size_t bytes) noexcept {
  for (std::size_t gone = 0; gone < bytes && kept_host_bytes_ > 0;) {
    entry* soonest = nullptr;
    for (entry* e : resident_) {
      if (e->host.defined() && (soonest == nullptr || e->seq > soonest->seq)) soonest = e;
    }
    if (soonest == nullptr) return;  // (kept_host_bytes_ counts only these)
    gone += soonest->nbytes;
    let_go_of_host(*soonest);
  }
}

void activation_manager::let_go_of_host(entry& e) noexcept {
  if (e.state != entry_state::resident || !e.host.defined()) return;
  e.host.reset();  // on CUDA a copy back still reading it holds the pinned block (its event)
  e.host_version.reset();
  kept_host_bytes_ -= e.nbytes;
}

at::Tensor activation_manager::spill_buffer(const entry& e) {
  if (!room_for_spill(e.nbytes)) return {};
  // Host memory (pinned, for CUDA) exhausted: once more without the kept copies, which a
  // prefetch would otherwise have freed.
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      return host_bytes(e.nbytes, e.device.is_cuda(), options_.host_allocator);
    } catch (const std::exception&) {
      if (kept_host_bytes_ == 0) break;
      let_go_of_kept(kept_host_bytes_);
    }
  }
  return {};
}

void activation_manager::copy_out(entry& e, at::Tensor host) {
  at::Tensor source = byte_view(e.storage, e.nbytes);
  e.host = std::move(host);
  if (!e.device.is_cuda()) {
    copy_on_host(e.host, source, link_direction::to_host);
    return;
  }
  const c10::DeviceIndex device = e.device.index();
  room_for_copy(device);
  auto d2h = copy_streams(device).first;
  if (e.copy) d2h.unwrap().wait(*e.copy);  // restored ahead, its copy back may still run
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  if (e.saved_on && *e.saved_on != current.unwrap()) {  // its bytes were made there
    (void)wait_for(d2h, c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *e.saved_on));
  }
  c10::Event ready = wait_for(d2h, current);
  c10::Event start = timing_event(d2h);
  {
    c10::cuda::CUDAStreamGuard guard(d2h);
    e.host.copy_(source, /*non_blocking=*/true);
  }
  source.record_stream(d2h.unwrap());  // the block is not reused before the copy has read it
  c10::Event copied(c10::DeviceType::CUDA);
  copied.record(d2h.unwrap());
  c10::Event end = timing_event(d2h);
  // Nothing below throws. Until here a restore's event (an entry restored ahead) stays the one
  // its unpack waits for, should the spill fail and the entry stay resident.
  e.copy = std::move(copied);
  list_copy({device, link_direction::to_host, e.nbytes, std::move(start), std::move(end),
             std::move(ready)});
}


void activation_manager::copy_in(entry& e, bool keep_host) {
  {
    // Allocators serve the current device: the storage's, not the caller's (a prefetch on
    // another device's backward, a multi-device segment).
    const c10::OptionalDeviceGuard on_its_device(e.device);
    e.storage.set_data_ptr_noswap(e.storage.allocator()->allocate(e.nbytes));
    if (e.device.is_cuda()) e.allocated_on = c10::cuda::getCurrentCUDAStream(e.device.index()).unwrap();
  }
  e.storage.set_nbytes(e.nbytes);
  std::optional<c10::cuda::CUDAStream> queued;  // the stream of a copy queued into the block
  try {
    at::Tensor target = byte_view(e.storage, e.nbytes);
    if (e.device.is_cuda()) {
      note_copies();
      room_for_copy(e.device.index());
      auto h2d = copy_streams(e.device.index()).second;
      // The spill's copy has completed (after a clean eviction: the copy back before it, which
      // came after that spill's).
      if (e.copy) h2d.unwrap().wait(*e.copy);
      wait_for(h2d, c10::cuda::getCurrentCUDAStream(e.device.index()));  // the new block is ready
      c10::Event start = timing_event(h2d);
      {
        c10::cuda::CUDAStreamGuard guard(h2d);
        target.copy_(e.host, /*non_blocking=*/true);  // the pinned buffer is kept until done
      }
      queued = h2d;
      target.record_stream(h2d.unwrap());
      c10::Event done(c10::DeviceType::CUDA);
      done.record(h2d.unwrap());  // unpack makes the compute stream wait for it
      c10::Event end = timing_event(h2d);
      e.copy = std::move(done);   // the spilled entry's event is kept until nothing can fail
      list_copy({e.device.index(), link_direction::to_device, e.nbytes, std::move(start),
                 std::move(end), std::nullopt});
    } else {
      copy_on_host(target, e.host, link_direction::to_device);
    }
  } catch (...) {
    // Host memory ran out on the way (Note [Host out of memory]): the entry stays spilled, with
    // its host copy and its event, and the memory taken for it goes back, after a copy
    // already queued into it is done (it was freed in the current stream's order otherwise).
    if (queued) queued->synchronize();
    e.storage.set_data_ptr_noswap(at::DataPtr(nullptr, e.device));
    e.storage.set_nbytes(0);
    throw;
  }
  // Kept only while a change to the bytes would show (the version counter is enabled).
  e.host_version = keep_host ? detail::version_of(e.version) : std::nullopt;
  if (e.host_version) {
    kept_host_bytes_ += e.nbytes;
  } else {
    e.host.reset();
  }
  e.state = entry_state::resident;
  e.last_use = now_seconds();  // a restore is a use: a prefetched entry is not the next victim
  spilled_.erase(e.seq);
  spilled_bytes_ -= e.nbytes;
  became_resident(e);
  ++counters_.restores;
  counters_.bytes_restored += e.nbytes;
}

// Room for `e` under max_resident and in the allocator its memory came from, without evicting.
bool activation_manager::room_to_prefetch(const entry& e) const {
  if (const auto cap = options_.max_resident;
      cap && resident_bytes_ + e.nbytes > *cap && evictable_resident_bytes() + e.nbytes > *cap) {
    return false;  // the cap would evict it, or another, at once (the scan only when it may)
  }
  if (e.home == nullptr) return true;  // no budget of spillway's holds it
  const void* stream = e.device.is_cuda()
                           ? static_cast<const void*>(c10::cuda::getCurrentCUDAStream(e.device.index()).stream())
                           : nullptr;  // copy_in allocates on the current stream (CPU: the default)
  return e.home->fits_without_eviction(e.nbytes, pressure_source_->stream_of(stream));
}

// A storage restored ahead went unread. Evicted, the depth was more than the room lasts, so it
// halves, once between two unpacks however many go in that pressure (one loss event, as a
// congestion window counts it; per storage, one sweep took a depth of 4 to 0.25). Let go (its
// node was never run), nothing ran out: no back-off. Under tight budgets a fixed depth of 2 had a
// fifth to three fifths of the copies back taken back unread
// (bench/results/sim-2026-11-27-prefetch-depth/).
void activation_manager::prefetch_wasted(entry& e, bool evicted) noexcept {
  ++counters_.prefetches_unused;
  e.prefetched = false;
  if (evicted && !backed_off_) {
    prefetch_depth_ /= 2;
    backed_off_ = true;
  }
}

// Only an entry autograd will unpack is restored ahead: a segment's input that nothing but the
// segment holds is read by its replay alone, which restores it then (in spill mode there is no
// replay at all). Restoring those filled the budget with storages nothing would read, and, on
// CUDA, where a restored entry stayed unevictable until its unpack, held them to the step's end.
void activation_manager::prefetch_before(std::uint64_t seq) {
  const auto depth = static_cast<std::size_t>(prefetch_depth_);
  std::vector<entry*> next;
  for (auto it = spilled_.lower_bound(seq); it != spilled_.begin() && next.size() < depth;) {
    entry* e = (--it)->second;
    if (e->unpackable > 0) next.push_back(e);
  }
  for (entry* e : next) {
    // A prefetch is only ahead of time: it takes room the budget has, and never makes the
    // allocator evict (it would evict what backward reads next, and what it prefetched: on the
    // simulated device, test_torch_budget_cpu's transformer at 50% had about half of its
    // prefetches evicted unread, bench/results/gpu-2026-11-27-h200/cpu_prefetch/).
    // No room, or out of memory all the same, stops prefetching; the entry is copied back when
    // it is unpacked.
    if (!room_to_prefetch(*e)) return;
    try {
      copy_in(*e, /*keep_host=*/true);
      e->prefetched = true;
    } catch (const c10::OutOfMemoryError&) {  // spillway's c10 allocators throw this one
      return;
    }
    ++counters_.prefetches;
  }
}

}  // namespace spillway::torch_plugin
