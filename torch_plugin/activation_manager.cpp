// activation_manager.cpp: options, lifetime, pack and unpack, statistics. The contract is in
// activation_manager.hpp; the other files are listed in activation_manager_impl.hpp.
#include "activation_manager.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "activation_manager_impl.hpp"
#include "spillway/errors.hpp"

namespace spillway::torch_plugin {

namespace {

using detail::now_seconds;

// Managers alive and the counters of those gone, for totals().
std::mutex& registry_mutex = *new std::mutex;
std::vector<std::weak_ptr<activation_manager>>& registry =
    *new std::vector<std::weak_ptr<activation_manager>>;
activation_stats& retired = *new activation_stats;

// A rate as a counter: rounded down, within the counter's range (a configured 1e30 B/s too).
std::uint64_t saturated(double v) noexcept {
  if (!(v > 0)) return 0;
  if (v >= 18446744073709551615.0) return std::numeric_limits<std::uint64_t>::max();
  return static_cast<std::uint64_t>(v);
}

void add_counters(activation_stats& into, const activation_stats& s) {
  into.packed += s.packed;
  into.evictions += s.evictions;
  into.spills += s.spills;
  into.drops += s.drops;
  into.restores += s.restores;
  into.recomputes += s.recomputes;
  into.recompute_moves += s.recompute_moves;
  into.recomputes_stopped += s.recomputes_stopped;
  into.nested_recomputes += s.nested_recomputes;
  into.spill_fallbacks += s.spill_fallbacks;
  into.bytes_spilled += s.bytes_spilled;
  into.bytes_dropped += s.bytes_dropped;
  into.bytes_restored += s.bytes_restored;
  into.prefetches += s.prefetches;
  into.prefetches_unused += s.prefetches_unused;
  into.clean_evictions += s.clean_evictions;
  into.unpacks_waiting += s.unpacks_waiting;
  into.pressure_calls += s.pressure_calls;
  into.evict_ns += s.evict_ns;
}

}  // namespace

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
  std::vector<std::pair<std::string, std::uint64_t>> out{
      {"packed", packed},
      {"evictions", evictions},
      {"spills", spills},
      {"drops", drops},
      {"restores", restores},
      {"recomputes", recomputes},
      {"recompute_moves", recompute_moves},
      {"recomputes_stopped", recomputes_stopped},
      {"nested_recomputes", nested_recomputes},
      {"spill_fallbacks", spill_fallbacks},
      {"bytes_spilled", bytes_spilled},
      {"bytes_dropped", bytes_dropped},
      {"bytes_restored", bytes_restored},
      {"prefetches", prefetches},
      {"prefetches_unused", prefetches_unused},
      {"clean_evictions", clean_evictions},
      {"unpacks_waiting", unpacks_waiting},
      {"pressure_calls", pressure_calls},
      {"evict_ns", evict_ns},
      {"registered", registered},
      {"resident_bytes", resident_bytes},
      {"spilled_bytes", spilled_bytes},
      {"kept_host_bytes", kept_host_bytes},
      {"dropped_bytes", dropped_bytes}};
  if (has_link) {
    out.emplace_back("prefetch_depth", prefetch_depth);
    out.emplace_back("spill_bytes_per_s", spill_bytes_per_s);
    out.emplace_back("restore_bytes_per_s", restore_bytes_per_s);
  }
  return out;
}

// --- lifetime ------------------------------------------------------------------------------------

std::shared_ptr<activation_manager> activation_manager::make(activation_options options,
                                                             plugin_allocator* pressure_source) {
  if (options.link_bandwidth &&
      !(*options.link_bandwidth > 0 && std::isfinite(*options.link_bandwidth))) {
    throw invalid_argument("spillway.activations: link_bandwidth " +
                           std::to_string(*options.link_bandwidth) +
                           " is invalid: expected bytes per second > 0, or none (Python: None) to "
                           "measure it");
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
          const device_allocator* memory = self->pressure_source_->created_device(r.device);
          if (memory == nullptr) return {};
          auto [freed, pinned] = self->evict_for(r, *memory);
          return {freed, pinned};
        });
  }
  std::lock_guard lock(registry_mutex);
  registry.push_back(m);
  return m;
}

activation_manager::activation_manager(activation_options options, plugin_allocator* pressure_source)
    : options_(options),
      pressure_source_(pressure_source),
      prefetch_depth_(static_cast<double>(options.prefetch)),
      link_(options.link_bandwidth.value_or(activation_options::default_link_bandwidth),
            /*fixed=*/options.link_bandwidth.has_value()) {}

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
                                 at::Tensor alias, bool by_autograd)
    : manager_(std::move(manager)), entry_(e), alias_(std::move(alias)), by_autograd_(by_autograd) {}

activation_manager::saved::~saved() { manager_->release(*this); }

void activation_manager::release(saved& handle) noexcept {
  std::lock_guard lock(mutex_);
  handle.alias_.reset();
  entry& e = *handle.entry_;
  if (handle.by_autograd_) --e.unpackable;
  if (--e.aliases == 0) forget(e);
  settle_last_ended();  // an output it held may be gone now
}

void activation_manager::forget(entry& e) {
  if (e.users > 0) {  // a recomputation refers to it: it goes when that is done
    e.orphaned = true;
    return;
  }
  if (e.prefetched) prefetch_wasted(e, /*evicted=*/false);
  if (e.state == entry_state::resident) {
    let_go_of_host(e);
    left_resident(e);
  }
  if (e.state == entry_state::spilled) {
    spilled_.erase(e.seq);
    spilled_bytes_ -= e.nbytes;
  }
  // Destroyed once the map is consistent again: the last entry of a segment releases it, and
  // with it the segment's held inputs, whose entries may be forgotten in turn (re-entering here).
  auto node = entries_.extract(e.storage.unsafeGetStorageImpl());
}

// --- pack and unpack -------------------------------------------------------------------------------

activation_manager::thread_segments* activation_manager::this_thread_segments() {
  auto it = segments_by_thread_.find(std::this_thread::get_id());
  return it == segments_by_thread_.end() ? nullptr : &it->second;
}

void activation_manager::note_saved(entry* e) {
  // Every segment open on this thread lists everything saved while it ran (nested segments
  // included): a replay saves the same tensors in the same order. Room first (grown
  // geometrically): the lists grow all or none.
  thread_segments* t = this_thread_segments();
  if (t == nullptr) return;
  for (auto& s : t->open) {
    if (s->saved.size() == s->saved.capacity()) s->saved.reserve(2 * s->saved.size() + 16);
  }
  for (auto& s : t->open) {
    if (e == nullptr) {
      s->saved.emplace_back(std::nullopt);
    } else {
      s->saved.emplace_back(segment::saved_storage{e->storage.getWeakStorageImpl(), e->seq});
    }
  }
}

std::shared_ptr<activation_manager::saved> activation_manager::pack(const at::Tensor& tensor) {
  return hold(tensor, /*saved_by_autograd=*/true);
}

// The segment that ended last on this thread, if `tensor` is one of its outputs, unchanged since:
// its replay returns that storage again.
std::shared_ptr<activation_manager::segment> activation_manager::producer_of(const at::Tensor& tensor) {
  const thread_segments* t = this_thread_segments();
  if (t == nullptr) return nullptr;
  const std::shared_ptr<segment>& last = t->last_ended;
  if (!last || !last->replayable) return nullptr;
  for (const auto& [weak, version] : last->outputs) {
    if (weak && weak->lock().get() == tensor.storage().unsafeGetStorageImpl()) {
      return detail::version_of(tensor) == version ? last : nullptr;
    }
  }
  return nullptr;
}

// The segment that ended last on a thread is kept for producer_of only while one of its outputs
// may still be registered: none is, once each is gone or has its entry. Then it goes (unless
// entries hold it), and with it the chain of boundaries its inputs hold. Every thread's is looked
// at: a handle released on one thread may settle another's.
void activation_manager::settle_last_ended() {
  // Let go after the walk: a segment that goes may release handles, which come back here.
  std::vector<std::shared_ptr<segment>> done;
  try {
    done.reserve(segments_by_thread_.size());
  } catch (...) {
    return;  // out of host memory: a later call settles them
  }
  for (auto it = segments_by_thread_.begin(); it != segments_by_thread_.end();) {
    thread_segments& t = it->second;
    if (t.last_ended && settled(*t.last_ended)) done.push_back(std::move(t.last_ended));
    it = t.open.empty() && !t.last_ended ? segments_by_thread_.erase(it) : std::next(it);
  }
}

bool activation_manager::settled(const segment& s) const {
  for (const auto& output : s.outputs) {
    if (!output.first) continue;
    c10::intrusive_ptr<c10::StorageImpl> storage = output.first->lock();
    if (storage && entries_.count(storage.get()) == 0) return false;
  }
  return true;
}

// pack, and a segment's input (begin_segment): the same entry per storage. Only autograd's saves
// are listed in the open segments (a replay saves the same tensors in the same order), and only
// they take an open segment as lineage: an input of no segment's list could not be refilled by
// one. Otherwise a new entry's lineage is the segment that returned it, if any (producer_of).
std::shared_ptr<activation_manager::saved> activation_manager::hold(const at::Tensor& tensor,
                                                                    bool saved_by_autograd) {
  std::lock_guard lock(mutex_);
  // Parameters (leaves that require grad) are the program's, not activations.
  const bool supported = tensor.defined() && tensor.has_storage() &&
                         (tensor.device().is_cpu() || tensor.device().is_cuda()) &&
                         !(tensor.is_leaf() && tensor.requires_grad());
  if (!supported || tensor.storage().nbytes() < options_.min_bytes) {
    if (saved_by_autograd) note_saved(nullptr);
    return nullptr;  // kept as it is
  }
  // Host memory may run out at each allocation below (Note [Host out of memory]): the entry is
  // entered whole or not at all, and a handle that cannot be made lets it go again.
  const c10::Storage& storage = tensor.storage();
  entry* e = nullptr;
  if (auto it = entries_.find(storage.unsafeGetStorageImpl()); it != entries_.end()) {
    e = it->second.get();
  } else {
    if (resident_.capacity() <= entries_.size()) {  // see resident_; grown geometrically
      resident_.reserve(std::max<std::size_t>(2 * resident_.capacity(), 64));
    }
    auto fresh = std::make_unique<entry>();
    fresh->storage = storage;
    fresh->nbytes = storage.nbytes();
    fresh->device = storage.device();
    fresh->last_use = now_seconds();
    fresh->version = tensor.unsafeGetTensorImpl()->version_counter();
    if (fresh->device.is_cuda()) {
      fresh->saved_on = c10::cuda::getCurrentCUDAStream(fresh->device.index()).unwrap();
    }
    const thread_segments* t = this_thread_segments();
    if (saved_by_autograd && t != nullptr && !t->open.empty()) {
      fresh->lineage = t->open.back();
    } else {
      fresh->lineage = producer_of(tensor);
    }
    // Its bytes now are those its lineage gives back: an output of a segment ended already; or
    // one saved while its segment runs (nobody but autograd holds it once it is evictable, so it
    // cannot change after a drop; changed before one, it waits for the segment's end).
    if (fresh->lineage) fresh->lineage_version = detail::version_of(fresh->version);
    e = entries_.emplace(storage.unsafeGetStorageImpl(), std::move(fresh)).first->second.get();
    e->seq = next_seq_++;
    // Until its first copy, the link stats() reports is that of the first device it holds.
    if (link_device_ == -1 && !link_copied_ && e->device.is_cuda()) link_device_ = e->device.index();
    became_resident(*e);
  }
  std::shared_ptr<saved> handle;
  ++e->aliases;
  try {
    handle = std::make_shared<saved>(shared_from_this(), e, tensor.detach(), saved_by_autograd);
  } catch (...) {
    if (--e->aliases == 0) forget(*e);
    throw;
  }
  if (saved_by_autograd) ++e->unpackable;  // the handle's release counts it down
  // From here the handle owns the alias: should anything below throw, it lets the entry go. Once
  // note_saved has listed the save in the open segments it stays listed, whatever throws after
  // (a program that goes on saves it again in the replay, which must stay aligned with the list).
  // A failure before that (host memory for the entry, the handle or the list) leaves it unlisted:
  // a program that catches it inside a segment and goes on is out of step with its replay.
  e->orphaned = false;  // saved again while a recomputation used it: it has a handle once more
  if (saved_by_autograd) {
    note_saved(e);
    ++counters_.packed;
  }
  settle_last_ended();
  enforce_max_resident();
  return handle;
}

at::Tensor activation_manager::unpack(const saved& handle) {
  std::lock_guard lock(mutex_);
  entry& e = *handle.entry_;
  const bool waits = e.state == entry_state::spilled;  // not restored ahead, or taken back
  make_resident(e);
  if (waits) {  // the copy back is waited for: restoring further ahead would have hidden it
    ++counters_.unpacks_waiting;
    prefetch_depth_ = std::min(prefetch_depth_ + 1, static_cast<double>(options_.prefetch));
  }
  backed_off_ = false;  // a new interval: the next evictions of prefetches are a new loss
  let_go_of_host(e);  // read now: a prefetch's kept copy is no longer worth its host memory
  // A fresh alias: while autograd uses it the storage's use count exceeds the manager's aliases,
  // so the storage cannot be evicted under the running backward node. Taken before the prefetch:
  // its allocations may call the pressure handler, which would otherwise see this storage
  // resident and unused, evict it, and hand autograd a tensor without memory.
  at::Tensor used = alias_in_use(handle);
  e.prefetched = false;
  prefetch_before(e.seq);
  wait_for_copy_back(e);
  enforce_max_resident();
  return used;
}

// A segment's input that a replay reads (make_resident): resident, as unpack makes it, but not
// one of autograd's unpacks. It neither moves the prefetch depth nor prefetches from its place in
// pack order, and keeps a prefetch's host copy and mark: autograd may still unpack it later.
at::Tensor activation_manager::read_for_replay(const saved& handle) {
  entry& e = *handle.entry_;
  make_resident(e);
  at::Tensor used = alias_in_use(handle);
  wait_for_copy_back(e);
  enforce_max_resident();
  return used;
}

at::Tensor activation_manager::alias_in_use(const saved& handle) {
  handle.entry_->last_use = now_seconds();
  return handle.alias_.detach();
}

void activation_manager::wait_for_copy_back(entry& e) {
  if (e.allocated_on) {
    // A reader on another stream than the block's: its free must wait for this reader's work.
    const c10::cuda::CUDAStream reader = c10::cuda::getCurrentCUDAStream(e.device.index());
    if (reader.unwrap() != *e.allocated_on) {
      c10::cuda::CUDACachingAllocator::recordStream(e.storage.data_ptr(), reader);
    }
  }
  if (!e.copy) return;
  if (e.copy->query()) {  // landed: nothing left to order after
    e.copy.reset();
    return;
  }
  // Still in flight: this stream waits, and the event stays for the next unpack of the storage,
  // which may come on another stream (a storage saved by two ops).
  c10::cuda::getCurrentCUDAStream(e.device.index()).unwrap().wait(*e.copy);
}

void activation_manager::enforce_max_resident() {
  std::lock_guard lock(mutex_);
  if (!options_.max_resident || resident_bytes_ <= *options_.max_resident) return;
  const std::size_t evictable_bytes = evictable_resident_bytes();
  if (evictable_bytes > *options_.max_resident) evict(evictable_bytes - *options_.max_resident);
}

// What max_resident caps: storages the program still holds do not count, or a cap below them
// would evict everything else at every pack and unpack.
std::size_t activation_manager::evictable_resident_bytes() const {
  std::size_t held = 0;
  for (const entry* e : resident_) {
    if (!evictable(*e)) held += e->nbytes;
  }
  return resident_bytes_ - held;
}

void activation_manager::end_scope() {
  std::shared_ptr<segment> last;
  {
    std::lock_guard lock(mutex_);
    enforce_max_resident();
    if (auto it = segments_by_thread_.find(std::this_thread::get_id()); it != segments_by_thread_.end()) {
      last = std::move(it->second.last_ended);
      if (it->second.open.empty()) segments_by_thread_.erase(it);
    }
  }
  // Released outside the lock: may forget entries, which takes it again.
}

// --- introspection -----------------------------------------------------------------------------------

activation_stats activation_manager::stats() const {
  std::lock_guard lock(mutex_);
  activation_stats s = counters_;
  s.registered = entries_.size();
  s.resident_bytes = resident_bytes_;
  s.spilled_bytes = spilled_bytes_;
  s.kept_host_bytes = kept_host_bytes_;
  s.prefetch_depth = static_cast<std::uint64_t>(prefetch_depth_);
  s.has_link = true;
  s.spill_bytes_per_s = saturated(link_.bytes_per_s(link_device_, link_direction::to_host));
  s.restore_bytes_per_s = saturated(link_.bytes_per_s(link_device_, link_direction::to_device));
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
    out.kept_host_bytes += s.kept_host_bytes;
    out.dropped_bytes += s.dropped_bytes;
  }
  return out;
}

}  // namespace spillway::torch_plugin
