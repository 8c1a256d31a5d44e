// activation_manager.cpp: the contract is in activation_manager.hpp.
#include "activation_manager.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Functions.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <unordered_set>

#include "spillway/errors.hpp"

namespace spillway::torch_plugin {

namespace {

double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Managers alive and the counters of those gone, for totals().
std::mutex& registry_mutex = *new std::mutex;
std::vector<std::weak_ptr<activation_manager>>& registry =
    *new std::vector<std::weak_ptr<activation_manager>>;
activation_stats& retired = *new activation_stats;

void add_counters(activation_stats& into, const activation_stats& s) {
  into.packed += s.packed;
  into.evictions += s.evictions;
  into.spills += s.spills;
  into.drops += s.drops;
  into.restores += s.restores;
  into.recomputes += s.recomputes;
  into.recompute_moves += s.recompute_moves;
  into.spill_fallbacks += s.spill_fallbacks;
  into.bytes_spilled += s.bytes_spilled;
  into.bytes_dropped += s.bytes_dropped;
  into.bytes_restored += s.bytes_restored;
  into.prefetches += s.prefetches;
  into.pressure_calls += s.pressure_calls;
}

// The default generators of the CPU and of `cuda_devices`, set to a segment's state for a replay
// and put back afterwards, even when the replay throws.
struct generator_states {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;

  static generator_states capture(const std::vector<c10::DeviceIndex>& devices) {
    generator_states s;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard lock(gen.mutex());
      s.cpu = gen.get_state();
    }
    for (c10::DeviceIndex d : devices) {
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(d);
      std::lock_guard lock(gen.mutex());
      s.cuda.emplace_back(d, gen.get_state());
    }
    return s;
  }
  void apply() const {
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard lock(gen.mutex());
      gen.set_state(cpu);
    }
    for (const auto& [d, state] : cuda) {
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(d);
      std::lock_guard lock(gen.mutex());
      gen.set_state(state);
    }
  }
};

}  // namespace

enum class entry_state { resident, spilled, dropped };

struct activation_manager::segment {
  segment_replay replay;
  std::vector<c10::DeviceIndex> cuda_devices;
  generator_states rng;
  // Every pack while it ran, in order (nullopt: kept as it is). Weak references: they do not keep
  // a storage's memory, but they keep its StorageImpl's address from being reused by another
  // storage, whose entry a replay would otherwise take for this segment's and refill.
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>> saved;
  double cost_s = 0;
  std::optional<c10::Event> start, end;  // CUDA timing, read once complete
};

struct activation_manager::entry {
  c10::Storage storage;
  std::size_t nbytes = 0;
  c10::Device device{c10::DeviceType::CPU};
  std::size_t aliases = 0;
  entry_state state = entry_state::resident;
  at::Tensor host;                       // spilled bytes
  std::optional<c10::Event> copy;        // CUDA: the copy the next user waits for
  std::shared_ptr<segment> lineage;      // the checkpoint segment that made it
  std::uint64_t seq = 0;
  double last_use = 0;
  int pins = 0;                          // > 0 while a recomputation needs it resident
  bool orphaned = false;                 // its last handle went while it was pinned
};

// --- options -------------------------------------------------------------------------------------

activation_mode parse_activation_mode(std::string_view name) {
  if (name == "hybrid") return activation_mode::hybrid;
  if (name == "spill") return activation_mode::spill;
  if (name == "drop") return activation_mode::drop;
  throw invalid_argument("spillway.activations: mode '" + std::string(name) +
                         "' is invalid: expected one of hybrid, spill, drop");
}

activation_policy parse_activation_policy(std::string_view name) {
  if (name == "dtr") return activation_policy::dtr;
  if (name == "lru") return activation_policy::lru;
  if (name == "largest") return activation_policy::largest;
  throw invalid_argument("spillway.activations: policy '" + std::string(name) +
                         "' is invalid: expected one of dtr, lru, largest");
}

std::vector<std::pair<std::string, std::uint64_t>> activation_stats::fields() const {
  return {{"packed", packed},           {"evictions", evictions},
          {"spills", spills},           {"drops", drops},
          {"restores", restores},       {"recomputes", recomputes},
          {"recompute_moves", recompute_moves}, {"spill_fallbacks", spill_fallbacks},
          {"bytes_spilled", bytes_spilled}, {"bytes_dropped", bytes_dropped},
          {"bytes_restored", bytes_restored}, {"prefetches", prefetches},
          {"pressure_calls", pressure_calls}, {"registered", registered},
          {"resident_bytes", resident_bytes}, {"spilled_bytes", spilled_bytes},
          {"dropped_bytes", dropped_bytes}};
}

// --- lifetime ------------------------------------------------------------------------------------

std::shared_ptr<activation_manager> activation_manager::make(activation_options options,
                                                             plugin_allocator* pressure_source) {
  if (!(options.link_bandwidth > 0)) {
    throw invalid_argument("spillway.activations: link_bandwidth " +
                           std::to_string(options.link_bandwidth) +
                           " is invalid: expected bytes per second > 0");
  }
  std::shared_ptr<activation_manager> m(new activation_manager(options, pressure_source));
  if (pressure_source != nullptr) {
    std::weak_ptr<activation_manager> weak = m;
    m->pressure_handler_ = pressure_source->add_pressure_handler(
        [weak](const pressure_request& r) -> pressure_result {
          auto self = weak.lock();
          if (!self) return {};
          std::unique_lock lock(self->mutex_, std::try_to_lock);
          if (!lock.owns_lock()) return {};  // busy on another thread: see the contract
          ++self->counters_.pressure_calls;
          auto [freed, pinned] = self->evict(std::max({r.bytes, r.shortfall, std::size_t{1}}),
                                             self->pressure_source_->created_device(r.device));
          return {freed, pinned};
        });
  }
  std::lock_guard lock(registry_mutex);
  registry.push_back(m);
  return m;
}

activation_manager::activation_manager(activation_options options, plugin_allocator* pressure_source)
    : options_(options), pressure_source_(pressure_source) {}

activation_manager::~activation_manager() {
  close();
  std::lock_guard lock(registry_mutex);
  add_counters(retired, counters_);
}

void activation_manager::close() {
  std::lock_guard lock(mutex_);
  if (pressure_handler_ != 0) {
    pressure_source_->remove_pressure_handler(pressure_handler_);
    pressure_handler_ = 0;
  }
}

activation_manager::saved::saved(std::shared_ptr<activation_manager> manager, entry* e,
                                 at::Tensor alias)
    : manager_(std::move(manager)), entry_(e), alias_(std::move(alias)) {}

activation_manager::saved::~saved() { manager_->release(*this); }

void activation_manager::release(saved& handle) noexcept {
  std::lock_guard lock(mutex_);
  handle.alias_.reset();
  entry& e = *handle.entry_;
  if (--e.aliases == 0) forget(e);
}

void activation_manager::forget(entry& e) {
  if (e.pins > 0) {  // a recomputation is using it: it goes when that is done
    e.orphaned = true;
    return;
  }
  if (e.state == entry_state::resident) resident_bytes_ -= e.nbytes;
  if (e.state == entry_state::spilled) {
    spilled_.erase(e.seq);
    spilled_bytes_ -= e.nbytes;
  }
  entries_.erase(e.storage.unsafeGetStorageImpl());  // destroys e
}

// --- pack and unpack -------------------------------------------------------------------------------

void activation_manager::note_saved(entry* e) {
  // Every open segment lists everything saved while it ran (nested segments included): a replay
  // saves the same tensors in the same order.
  for (auto& s : open_segments_) {
    if (e == nullptr) {
      s->saved.emplace_back(std::nullopt);
    } else {
      s->saved.emplace_back(e->storage.getWeakStorageImpl());
    }
  }
}

std::shared_ptr<activation_manager::saved> activation_manager::pack(const at::Tensor& tensor) {
  std::lock_guard lock(mutex_);
  // Parameters (leaves that require grad) are the program's, not activations.
  const bool supported = tensor.defined() && tensor.has_storage() &&
                         (tensor.device().is_cpu() || tensor.device().is_cuda()) &&
                         !(tensor.is_leaf() && tensor.requires_grad());
  if (!supported || tensor.storage().nbytes() < options_.min_bytes) {
    note_saved(nullptr);
    return nullptr;  // kept as it is
  }
  const c10::Storage& storage = tensor.storage();
  auto& slot = entries_[storage.unsafeGetStorageImpl()];
  if (!slot) {
    slot = std::make_unique<entry>();
    slot->storage = storage;
    slot->nbytes = storage.nbytes();
    slot->device = storage.device();
    slot->seq = next_seq_++;
    slot->last_use = now_seconds();
    if (!open_segments_.empty()) slot->lineage = open_segments_.back();
    resident_bytes_ += slot->nbytes;
  }
  entry* e = slot.get();
  e->orphaned = false;  // saved again while a recomputation pinned it: it has a handle once more
  note_saved(e);
  ++e->aliases;
  ++counters_.packed;
  auto handle = std::make_shared<saved>(shared_from_this(), e, tensor.detach());
  enforce_max_resident();
  return handle;
}

at::Tensor activation_manager::unpack(const saved& handle) {
  std::lock_guard lock(mutex_);
  entry& e = *handle.entry_;
  make_resident(e);
  e.last_use = now_seconds();
  // A fresh alias: while autograd uses it the storage's use count exceeds the manager's aliases,
  // so the storage cannot be evicted under the running backward node. Taken before the prefetch:
  // its allocations may call the pressure handler, which would otherwise see this storage
  // resident and unused, evict it, and hand autograd a tensor without memory.
  at::Tensor used = handle.alias_.detach();
  prefetch_before(e.seq);
  if (e.copy) {  // a copy back (prefetched or not) still in flight
    c10::cuda::getCurrentCUDAStream(e.device.index()).unwrap().wait(*e.copy);
    e.copy.reset();
  }
  enforce_max_resident();
  return used;
}

void activation_manager::enforce_max_resident() {
  std::lock_guard lock(mutex_);
  if (!options_.max_resident || resident_bytes_ <= *options_.max_resident) return;
  // The cap is on what could be evicted: storages the program still holds do not count, or a
  // cap below them would evict everything else at every pack and unpack.
  std::size_t held = 0;
  for (const auto& [key, e] : entries_) {
    if (e->state == entry_state::resident && !evictable(*e)) held += e->nbytes;
  }
  const std::size_t evictable_bytes = resident_bytes_ - held;
  if (evictable_bytes > *options_.max_resident) evict(evictable_bytes - *options_.max_resident);
}

// --- eviction --------------------------------------------------------------------------------------

bool activation_manager::evictable(const entry& e) const {
  // The entry holds one reference, each alias one: anything more is a user of the storage.
  return e.state == entry_state::resident && e.pins == 0 && !e.copy &&
         e.storage.resizable() && e.storage.allocator() != nullptr &&
         e.storage.use_count() == e.aliases + 1 &&
         (options_.mode != activation_mode::drop || e.lineage != nullptr);
}

std::pair<double, bool> activation_manager::restore_cost(entry& e) {
  const double transfer = 2.0 * static_cast<double>(e.nbytes) / options_.link_bandwidth;
  if (!e.lineage || options_.mode == activation_mode::spill) return {transfer, false};
  segment& s = *e.lineage;
  if (s.end && s.end->query()) {  // the measured device time replaces the host's
    s.cost_s = s.start->elapsedTime(*s.end) / 1e3;
    s.start.reset();
    s.end.reset();
  }
  if (options_.mode == activation_mode::drop) return {s.cost_s, true};
  return s.cost_s <= transfer ? std::pair{s.cost_s, true} : std::pair{transfer, false};
}

activation_manager::entry* activation_manager::choose(std::vector<entry*>& candidates, double now) {
  auto score = [&](entry* e) -> double {
    switch (options_.policy) {
      case activation_policy::lru: return e->last_use;
      case activation_policy::largest: return -static_cast<double>(e->nbytes);
      case activation_policy::dtr: break;
    }
    // DTR: h = cost / (size x staleness); a tiny floor keeps free-to-restore victims ordered.
    return (restore_cost(*e).first + 1e-9) /
           (static_cast<double>(e->nbytes) * std::max(now - e->last_use, 1e-6));
  };
  std::size_t best = 0;
  double best_score = score(candidates[0]);
  for (std::size_t i = 1; i < candidates.size(); ++i) {
    const double s = score(candidates[i]);  // once per candidate
    if (s < best_score) {
      best = i;
      best_score = s;
    }
  }
  entry* victim = candidates[best];
  candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(best));
  return victim;
}

std::pair<std::size_t, std::size_t> activation_manager::evict(std::size_t wanted,
                                                              const device_allocator* memory_of) {
  std::lock_guard lock(mutex_);
  const auto in_scope = [memory_of](const entry& e) {
    return memory_of == nullptr ||
           (e.state == entry_state::resident && memory_of->owns(e.storage.data()));
  };
  std::vector<entry*> candidates;
  for (auto& [key, e] : entries_) {
    if (evictable(*e) && in_scope(*e)) candidates.push_back(e.get());
  }
  std::size_t freed = 0;
  const double now = now_seconds();
  while (freed < wanted && !candidates.empty()) {
    // Checked again: an eviction's own allocations (a spill's host copy on the CPU) may run the
    // pressure handler, which evicts from the same entries on this thread.
    entry& victim = *choose(candidates, now);
    if (evictable(victim)) freed += evict_one(victim);
  }
  std::size_t pinned = 0;
  for (auto& [key, e] : entries_) {
    if (e->state == entry_state::resident && !evictable(*e) && in_scope(*e)) pinned += e->nbytes;
  }
  return {freed, pinned};
}

namespace {
at::Tensor byte_view(const c10::Storage& storage, std::size_t nbytes) {
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()))
      .set_(storage, 0, {static_cast<int64_t>(nbytes)}, {1});
}
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
// The storages of `tensors` that nothing else holds: neither another tensor (a storage's use
// count is its tensors') nor another handle of one of these tensors.
std::unordered_set<c10::StorageImpl*> held_only_by(const std::vector<at::Tensor>& tensors) {
  std::unordered_map<c10::TensorImpl*, std::size_t> handles;  // of each tensor, in `tensors`
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.has_storage()) ++handles[t.unsafeGetTensorImpl()];
  }
  std::unordered_map<c10::StorageImpl*, std::size_t> tensors_of;  // distinct, in `tensors`
  std::unordered_set<c10::StorageImpl*> held_elsewhere;
  for (const auto& [impl, count] : handles) {
    c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
    ++tensors_of[storage];
    if (c10::raw::intrusive_ptr::use_count(impl) != count) held_elsewhere.insert(storage);
  }
  std::unordered_set<c10::StorageImpl*> only;
  for (const auto& [storage, count] : tensors_of) {
    if (held_elsewhere.count(storage) == 0 && c10::raw::intrusive_ptr::use_count(storage) == count) {
      only.insert(storage);
    }
  }
  return only;
}
// `waiter` waits for the work queued on `stream` so far.
void wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& stream) {
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(stream.unwrap());
  waiter.unwrap().wait(ready);
}
}  // namespace

at::Tensor activation_manager::spill_buffer(const entry& e) {
  if (options_.max_spilled && spilled_bytes_ + e.nbytes > *options_.max_spilled) return {};
  try {
    return host_bytes(e.nbytes, e.device.is_cuda(), options_.host_allocator);
  } catch (const std::exception&) {  // host memory (pinned, for CUDA) is exhausted
    return {};
  }
}

void activation_manager::copy_out(entry& e, at::Tensor host) {
  at::Tensor source = byte_view(e.storage, e.nbytes);
  e.host = std::move(host);
  if (!e.device.is_cuda()) {
    e.host.copy_(source);
    return;
  }
  auto d2h = copy_streams(e.device.index()).first;
  wait_for(d2h, c10::cuda::getCurrentCUDAStream(e.device.index()));
  {
    c10::cuda::CUDAStreamGuard guard(d2h);
    e.host.copy_(source, /*non_blocking=*/true);
  }
  source.record_stream(d2h.unwrap());  // the block is not reused before the copy has read it
  e.copy.emplace(c10::DeviceType::CUDA);
  e.copy->record(d2h.unwrap());
}

std::size_t activation_manager::evict_one(entry& e) {
  bool drop = restore_cost(e).second;
  at::Tensor host;
  if (!drop) {
    host = spill_buffer(e);
    if (!host.defined()) {  // no host memory for it (max_spilled, or none left): never lose it
      ++counters_.spill_fallbacks;
      if (e.lineage == nullptr || options_.mode == activation_mode::spill) return 0;
      drop = true;  // its segment recomputes it
    }
  }
  if (drop) {
    e.state = entry_state::dropped;
    ++counters_.drops;
    counters_.bytes_dropped += e.nbytes;
  } else {
    copy_out(e, std::move(host));
    e.state = entry_state::spilled;
    spilled_[e.seq] = &e;
    spilled_bytes_ += e.nbytes;
    ++counters_.spills;
    counters_.bytes_spilled += e.nbytes;
  }
  // Frees the memory (on CUDA in stream order after the copy) and keeps the StorageImpl.
  e.storage.set_data_ptr_noswap(at::DataPtr(nullptr, e.device));
  e.storage.set_nbytes(0);
  resident_bytes_ -= e.nbytes;
  ++counters_.evictions;
  return e.nbytes;
}

// --- restore ----------------------------------------------------------------------------------------

void activation_manager::make_resident(entry& e) {
  if (e.state == entry_state::spilled) {
    copy_in(e);
  } else if (e.state == entry_state::dropped) {
    recompute(*e.lineage);
    if (e.state != entry_state::resident) {
      throw std::runtime_error("spillway: recomputing a checkpoint segment did not restore an "
                               "activation of " + std::to_string(e.nbytes) +
                               " bytes (the segment saved fewer tensors the second time: it is "
                               "not deterministic)");
    }
  }
}

void activation_manager::copy_in(entry& e) {
  e.storage.set_data_ptr_noswap(e.storage.allocator()->allocate(e.nbytes));
  e.storage.set_nbytes(e.nbytes);
  at::Tensor target = byte_view(e.storage, e.nbytes);
  if (e.device.is_cuda()) {
    auto h2d = copy_streams(e.device.index()).second;
    if (e.copy) h2d.unwrap().wait(*e.copy);  // the spill's copy has completed
    wait_for(h2d, c10::cuda::getCurrentCUDAStream(e.device.index()));  // the new block is ready
    {
      c10::cuda::CUDAStreamGuard guard(h2d);
      target.copy_(e.host, /*non_blocking=*/true);  // the pinned buffer is kept until done
    }
    target.record_stream(h2d.unwrap());
    e.copy.emplace(c10::DeviceType::CUDA);
    e.copy->record(h2d.unwrap());  // unpack makes the compute stream wait for it
  } else {
    target.copy_(e.host);
  }
  e.host.reset();
  e.state = entry_state::resident;
  e.last_use = now_seconds();  // a restore is a use: a prefetched entry is not the next victim
  spilled_.erase(e.seq);
  spilled_bytes_ -= e.nbytes;
  resident_bytes_ += e.nbytes;
  ++counters_.restores;
  counters_.bytes_restored += e.nbytes;
}

void activation_manager::prefetch_before(std::uint64_t seq) {
  std::vector<entry*> next;
  for (auto it = spilled_.lower_bound(seq); it != spilled_.begin() && next.size() < options_.prefetch;) {
    next.push_back((--it)->second);
  }
  for (entry* e : next) {
    // A prefetch is only ahead of time: out of memory for it (the budget full of what backward
    // uses now) stops prefetching, and the entry is copied back when it is unpacked.
    try {
      copy_in(*e);
    } catch (const c10::OutOfMemoryError&) {  // spillway's c10 allocators throw this one
      return;
    }
    ++counters_.prefetches;
  }
}

void activation_manager::recompute(segment& s) {
  std::vector<entry*> members;
  for (const auto& weak : s.saved) {
    entry* e = nullptr;
    if (weak) {
      // A storage that is gone has no entry; one that lives is this segment's (see segment).
      if (c10::intrusive_ptr<c10::StorageImpl> storage = weak->lock()) {
        auto it = entries_.find(storage.get());
        if (it != entries_.end()) e = it->second.get();
      }
    }
    members.push_back(e);
  }
  for (entry* e : members) {
    if (e) ++e->pins;
  }
  struct unpin {
    activation_manager& self;
    std::vector<entry*>& members;
    ~unpin() {
      for (entry*& e : members) {
        if (e && --e->pins == 0 && e->orphaned) {
          self.forget(*e);
          e = nullptr;
        }
      }
    }
  } unpin_guard{*this, members};

  std::vector<at::Tensor> fresh;
  {
    const generator_states current = generator_states::capture(s.cuda_devices);
    struct put_back {
      const generator_states& states;
      ~put_back() { states.apply(); }
    } restore_guard{current};
    s.rng.apply();
    fresh = s.replay();
  }
  // Check every size first, so that a failing replay changes nothing.
  for (std::size_t i = 0; i < members.size() && i < fresh.size(); ++i) {
    entry* e = members[i];
    if (e == nullptr || e->state != entry_state::dropped) continue;
    const std::size_t got = fresh[i].defined() && fresh[i].has_storage() ? fresh[i].storage().nbytes() : 0;
    if (got != e->nbytes) {
      throw std::runtime_error("spillway: recomputing a checkpoint segment gave a storage of " +
                               std::to_string(got) + " bytes where the original had " +
                               std::to_string(e->nbytes) + ": the segment is not deterministic");
    }
  }
  // A fresh storage that only `fresh` holds gives its memory to the entry: no allocation and no
  // copy, so that a replay needs the segment's bytes once, not twice. One that something else
  // holds too (the segment's input, saved again) is copied, and so is one whose memory another
  // entry took already (a replay that aliases what the first run did not): from that entry.
  const std::unordered_set<c10::StorageImpl*> only_in_fresh = held_only_by(fresh);
  std::unordered_map<c10::StorageImpl*, entry*> taken_by;
  for (std::size_t i = 0; i < members.size() && i < fresh.size(); ++i) {
    entry* e = members[i];
    if (e == nullptr || e->orphaned || e->state != entry_state::dropped) continue;  // or refilled
    c10::StorageImpl* source = fresh[i].storage().unsafeGetStorageImpl();
    const auto taken = taken_by.find(source);
    if (taken == taken_by.end() && only_in_fresh.count(source) > 0 &&
        source->device() == e->device) {
      e->storage.set_data_ptr_noswap(source->set_data_ptr(at::DataPtr(nullptr, source->device())));
      source->set_nbytes(0);
      taken_by.emplace(source, e);
      ++counters_.recompute_moves;
    } else {
      const c10::Storage& from = taken == taken_by.end() ? fresh[i].storage() : taken->second->storage;
      e->storage.set_data_ptr_noswap(e->storage.allocator()->allocate(e->nbytes));
      byte_view(e->storage, e->nbytes).copy_(byte_view(from, e->nbytes));
    }
    e->storage.set_nbytes(e->nbytes);
    e->state = entry_state::resident;
    resident_bytes_ += e->nbytes;
  }
  ++counters_.recomputes;
}

// --- segments ---------------------------------------------------------------------------------------

void activation_manager::begin_segment(segment_replay replay,
                                       std::vector<c10::DeviceIndex> cuda_devices) {
  std::lock_guard lock(mutex_);
  auto s = std::make_shared<segment>();
  s->replay = std::move(replay);
  s->rng = generator_states::capture(cuda_devices);
  if (!cuda_devices.empty()) {
    s->start.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    s->start->record(c10::cuda::getCurrentCUDAStream(cuda_devices.front()).unwrap());
  }
  s->cuda_devices = std::move(cuda_devices);
  open_segments_.push_back(std::move(s));
}

void activation_manager::end_segment(double host_seconds) {
  std::lock_guard lock(mutex_);
  if (open_segments_.empty()) {
    throw invalid_argument("spillway: end_segment without begin_segment");
  }
  segment& s = *open_segments_.back();
  s.cost_s = host_seconds;
  if (s.start) {
    s.end.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    s.end->record(c10::cuda::getCurrentCUDAStream(s.cuda_devices.front()).unwrap());
  }
  open_segments_.pop_back();
}

// --- introspection -----------------------------------------------------------------------------------

activation_stats activation_manager::stats() const {
  std::lock_guard lock(mutex_);
  activation_stats s = counters_;
  s.registered = entries_.size();
  s.resident_bytes = resident_bytes_;
  s.spilled_bytes = spilled_bytes_;
  for (const auto& [key, e] : entries_) {
    if (e->state == entry_state::dropped) s.dropped_bytes += e->nbytes;
  }
  return s;
}

std::optional<std::string> activation_manager::state_of(const at::Tensor& tensor) const {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(tensor.storage().unsafeGetStorageImpl());
  if (it == entries_.end()) return std::nullopt;
  switch (it->second->state) {
    case entry_state::resident: return "resident";
    case entry_state::spilled: return "spilled";
    case entry_state::dropped: return "dropped";
  }
  return std::nullopt;
}

activation_stats activation_manager::totals() {
  std::vector<std::shared_ptr<activation_manager>> live;
  activation_stats out;
  {
    std::lock_guard lock(registry_mutex);
    out = retired;
    std::erase_if(registry, [](const auto& w) { return w.expired(); });
    for (auto& w : registry) {
      if (auto m = w.lock()) live.push_back(std::move(m));
    }
  }
  for (auto& m : live) {
    const activation_stats s = m->stats();
    add_counters(out, s);
    out.registered += s.registered;
    out.resident_bytes += s.resident_bytes;
    out.spilled_bytes += s.spilled_bytes;
    out.dropped_bytes += s.dropped_bytes;
  }
  return out;
}

}  // namespace spillway::torch_plugin
