// torch_allocator_history.cpp: the contract is in torch_allocator_history.hpp.
#include "torch_allocator_history.hpp"

#include <c10/util/ApproximateClock.h>

#include <utility>

namespace spillway::torch_plugin {

using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;

namespace {
constexpr std::size_t action_count = static_cast<std::size_t>(TraceEntry::Action::OOM) + 1;
}

void allocation_history::configure(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder,
                                   std::size_t max_entries, RecordContext when, bool clear,
                                   const std::vector<std::string>& skip_actions) {
  std::vector<bool> skipped(action_count, false);
  for (const std::string& name : skip_actions) {
    // parseTraceEntryAction names the accepted actions when it rejects one.
    skipped[static_cast<std::size_t>(c10::CachingDeviceAllocator::parseTraceEntryAction(name))] = true;
  }
  std::lock_guard lock(mutex_);
  enabled_ = enabled;
  recorder_.store(enabled ? recorder : nullptr);
  when_.store(enabled ? when : RecordContext::NEVER);
  max_entries_ = max_entries;
  skipped_ = std::move(skipped);
  if (clear || !enabled) {
    rings_.clear();
  }
  annotations_.clear();  // as PyTorch's allocator: at every call
  if (!enabled || when_.load() == RecordContext::NEVER) {
    live_contexts_.clear();
    freeing_contexts_.clear();
    segment_contexts_.clear();
  }
  for (auto& [device, ring] : rings_) {
    while (ring.size() > max_entries_) ring.pop_front();
  }
  active_.store(enabled_ || trackers_ != nullptr);
}

bool allocation_history::enabled() const {
  std::lock_guard lock(mutex_);
  return enabled_;
}

void allocation_history::attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
  std::lock_guard lock(mutex_);
  // Copied, not changed in place: entries being told to trackers outside the mutex keep theirs.
  auto trackers = trackers_ != nullptr ? std::make_shared<tracker_list>(*trackers_)
                                       : std::make_shared<tracker_list>();
  trackers->push_back(std::move(tracker));
  trackers_ = std::move(trackers);
  active_.store(true);
}

std::shared_ptr<c10::GatheredContext> allocation_history::gather(action what) const {
  // Gathered before any lock, as PyTorch's allocator does: torch's recorder takes the GIL, and a
  // thread that holds the GIL may be waiting for the mutex (a tensor freed from Python) while
  // this one holds it. An allocation's (and an OOM's) with STATE or more, a free's only with ALL.
  const auto recorder = recorder_.load();
  if (recorder == nullptr) return nullptr;
  const RecordContext when = when_.load();
  if (what == action::FREE_REQUESTED ? when == RecordContext::ALL : when >= RecordContext::STATE) {
    return recorder();
  }
  return nullptr;
}

void allocation_history::record(action what, c10::DeviceIndex device, std::size_t address,
                                std::size_t size, void* stream,
                                std::shared_ptr<c10::GatheredContext> context) {
  if (!active()) return;  // every allocation and free comes here: no lock when nobody listens
  std::unique_lock lock(mutex_);
  add_releasing_lock(lock, what, device, address, size, stream, std::move(context));
}

void allocation_history::record_free_completed(c10::DeviceIndex device, const void* ptr,
                                               std::size_t size, void* stream) {
  if (!active()) return;
  std::unique_lock lock(mutex_);
  add_releasing_lock(lock, action::FREE_COMPLETED, device, reinterpret_cast<std::size_t>(ptr), size,
                     stream, nullptr);
}

namespace {
// The innermost context_scope open on this thread, if any (scopes nest, of one history or several).
thread_local allocation_history::context_scope* current_scope = nullptr;

TraceEntry::Action trace_action(segment_change what) {
  switch (what) {
    case segment_change::allocated: return TraceEntry::SEGMENT_ALLOC;
    case segment_change::freed: return TraceEntry::SEGMENT_FREE;
    case segment_change::mapped: return TraceEntry::SEGMENT_MAP;
    case segment_change::unmapped: break;
  }
  return TraceEntry::SEGMENT_UNMAP;
}
}  // namespace

allocation_history::context_scope::context_scope(const allocation_history& history, action what)
    : history_(&history), outer_(current_scope), open_(history.active()) {
  if (!open_) return;  // nobody listens (every allocation comes here): nothing to gather or lend
  context_ = history.gather(what);
  current_scope = this;
}

void allocation_history::context_scope::close() noexcept {
  if (!open_) return;
  open_ = false;
  if (current_scope == this) {
    current_scope = outer_;
    return;
  }
  // Closed early under an inner scope: unlink it from the chain.
  for (context_scope* s = current_scope; s != nullptr; s = s->outer_) {
    if (s->outer_ == this) {
      s->outer_ = outer_;
      return;
    }
  }
}

void allocation_history::record_segment(segment_change what, c10::DeviceIndex device,
                                        const void* address, std::size_t size, void* stream) {
  if (!active()) return;
  std::shared_ptr<c10::GatheredContext> context;
  for (const context_scope* s = current_scope; s != nullptr; s = s->outer_) {
    if (s->history_ == this) {
      context = s->context();
      break;
    }
  }
  std::unique_lock lock(mutex_);
  if (what == segment_change::allocated && context && when_.load() >= RecordContext::STATE) {
    segment_contexts_[address] = context;
  } else if (what == segment_change::freed) {
    if (auto it = segment_contexts_.find(address); it != segment_contexts_.end()) {
      if (!context) context = std::move(it->second);
      segment_contexts_.erase(it);
    }
  }
  add_releasing_lock(lock, trace_action(what), device, reinterpret_cast<std::size_t>(address), size,
                     stream, std::move(context));
}

// Keeps the entry (and its context) under the mutex, then tells the trackers without it: a
// tracker (NCCL's register hook) may take its time, and the mutex is every device's.
void allocation_history::add_releasing_lock(std::unique_lock<std::mutex>& lock, action what,
                                            c10::DeviceIndex device, std::size_t address,
                                            std::size_t size, void* stream,
                                            std::shared_ptr<c10::GatheredContext> context) {
  const auto* ptr = reinterpret_cast<const void*>(address);
  const bool keeps_contexts = when_.load() >= RecordContext::STATE;
  if (what == action::ALLOC && context) {
    live_contexts_[ptr] = context;
  } else if (what == action::FREE_REQUESTED) {
    if (auto it = live_contexts_.find(ptr); it != live_contexts_.end()) {
      if (!context) context = std::move(it->second);  // the allocation's
      live_contexts_.erase(it);
    }
    if (context && keeps_contexts) freeing_contexts_[ptr] = context;
  } else if (what == action::FREE_COMPLETED) {
    if (auto it = freeing_contexts_.find(ptr); it != freeing_contexts_.end()) {
      context = std::move(it->second);
      freeing_contexts_.erase(it);
    }
  }

  const auto stack = compile_contexts_.find(device);
  const auto metadata = user_metadata_.find(device);
  TraceEntry entry(what, device, address, size, stream, {0, 0}, c10::getApproximateTime(),
                   when_.load() >= RecordContext::ALLOC ? std::move(context) : nullptr,
                   stack == compile_contexts_.end() || stack->second.empty() ? "N/A" : stack->second.back(),
                   metadata == user_metadata_.end() ? std::string() : metadata->second);
  std::shared_ptr<const tracker_list> trackers = trackers_;
  if (enabled_ && !skipped_[static_cast<std::size_t>(what)] && max_entries_ > 0) {
    auto& ring = rings_[device];
    if (ring.size() == max_entries_) ring.pop_front();
    if (trackers == nullptr) {
      ring.push_back(std::move(entry));
      return;
    }
    ring.push_back(entry);
  }
  lock.unlock();
  if (trackers != nullptr) {
    for (const auto& tracker : *trackers) tracker(entry);
  }
}

void allocation_history::push_compile_context(c10::DeviceIndex device, std::string context) {
  std::lock_guard lock(mutex_);
  if (enabled_) compile_contexts_[device].push_back(std::move(context));
}

void allocation_history::pop_compile_context(c10::DeviceIndex device) {
  std::lock_guard lock(mutex_);
  if (!enabled_) return;
  auto it = compile_contexts_.find(device);
  if (it != compile_contexts_.end() && !it->second.empty()) it->second.pop_back();
}

void allocation_history::set_user_metadata(c10::DeviceIndex device, std::string metadata) {
  std::lock_guard lock(mutex_);
  user_metadata_[device] = std::move(metadata);
}

std::string allocation_history::user_metadata(c10::DeviceIndex device) const {
  std::lock_guard lock(mutex_);
  auto it = user_metadata_.find(device);
  return it == user_metadata_.end() ? std::string() : it->second;
}

void allocation_history::record_annotation(
    c10::DeviceIndex device, const std::vector<std::pair<std::string, std::string>>& metadata) {
  c10::CachingDeviceAllocator::AnnotationEntry entry(device, c10::getApproximateTime());
  for (const auto& [name, value] : metadata) entry.recordUserMetadata(name, value);
  std::lock_guard lock(mutex_);
  if (!enabled_ || max_entries_ == 0) return;
  if (annotations_.size() == max_entries_) annotations_.pop_front();
  annotations_.push_back(std::move(entry));
}

std::vector<c10::CachingDeviceAllocator::AnnotationEntry> allocation_history::annotations() const {
  std::lock_guard lock(mutex_);
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> out(annotations_.begin(), annotations_.end());
  const auto to_ns = clock_.makeConverter();
  for (auto& e : out) e.time_.t_ = to_ns(e.time_.approx_t_) / 1000;  // time_us, as the traces'
  return out;
}

std::vector<TraceEntry> allocation_history::entries(c10::DeviceIndex device) const {
  std::lock_guard lock(mutex_);
  auto it = rings_.find(device);
  if (it == rings_.end()) return {};
  std::vector<TraceEntry> out(it->second.begin(), it->second.end());
  const auto to_ns = clock_.makeConverter();
  for (TraceEntry& e : out) e.time_.t_ = to_ns(e.time_.approx_t_) / 1000;  // time_us
  return out;
}

std::shared_ptr<c10::GatheredContext> allocation_history::segment_context(const void* address) const {
  std::lock_guard lock(mutex_);
  auto it = segment_contexts_.find(address);
  return it == segment_contexts_.end() ? nullptr : it->second;
}

std::shared_ptr<c10::GatheredContext> allocation_history::context_of(const void* ptr) const {
  std::lock_guard lock(mutex_);
  auto it = live_contexts_.find(ptr);
  return it == live_contexts_.end() ? nullptr : it->second;
}

}  // namespace spillway::torch_plugin
