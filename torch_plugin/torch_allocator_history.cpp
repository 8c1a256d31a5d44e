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
  if (!enabled || when_.load() == RecordContext::NEVER) {
    live_contexts_.clear();
    freeing_contexts_.clear();
  }
  for (auto& [device, ring] : rings_) {
    while (ring.size() > max_entries_) ring.pop_front();
  }
  active_.store(enabled_ || !trackers_.empty());
}

bool allocation_history::enabled() const {
  std::lock_guard lock(mutex_);
  return enabled_;
}

void allocation_history::attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
  std::lock_guard lock(mutex_);
  trackers_.push_back(std::move(tracker));
  active_.store(true);
}

void allocation_history::record(action what, c10::DeviceIndex device, std::size_t address,
                                std::size_t size, void* stream) {
  if (!active()) return;  // every allocation and free comes here: no lock when nobody listens
  // The context is gathered before the mutex is taken, as PyTorch's allocator does: torch's
  // recorder takes the GIL, and a thread that holds the GIL may be waiting for the mutex (a
  // tensor freed from Python) while this one holds it. An allocation's (and an OOM's) with STATE
  // or more, a free's only with ALL.
  std::shared_ptr<c10::GatheredContext> context;
  if (const auto recorder = recorder_.load(); recorder != nullptr) {
    const RecordContext when = when_.load();
    if (what == action::FREE_REQUESTED ? when == RecordContext::ALL : when >= RecordContext::STATE) {
      context = recorder();
    }
  }
  std::lock_guard lock(mutex_);
  add_locked(what, device, address, size, stream, std::move(context));
}

void allocation_history::record_free_completed(c10::DeviceIndex device, const void* ptr,
                                               std::size_t size, void* stream) {
  if (!active()) return;
  std::lock_guard lock(mutex_);
  add_locked(action::FREE_COMPLETED, device, reinterpret_cast<std::size_t>(ptr), size, stream, nullptr);
}

void allocation_history::add_locked(action what, c10::DeviceIndex device, std::size_t address,
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

  TraceEntry entry(what, device, address, size, stream, {0, 0}, c10::getApproximateTime(),
                   when_.load() >= RecordContext::ALLOC ? std::move(context) : nullptr);
  for (const auto& tracker : trackers_) tracker(entry);
  if (!enabled_ || skipped_[static_cast<std::size_t>(what)] || max_entries_ == 0) return;
  auto& ring = rings_[device];
  if (ring.size() == max_entries_) ring.pop_front();
  ring.push_back(std::move(entry));
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

std::shared_ptr<c10::GatheredContext> allocation_history::context_of(const void* ptr) const {
  std::lock_guard lock(mutex_);
  auto it = live_contexts_.find(ptr);
  return it == live_contexts_.end() ? nullptr : it->second;
}

}  // namespace spillway::torch_plugin
