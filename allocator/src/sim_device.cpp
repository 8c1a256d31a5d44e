// sim_device.cpp: the simulated device: one mutex over sim_memory (what it hands out) and
// sim_scheduler (streams, events, engines, clock), plus argument checks and fault injection.
//
// Every call that is not noexcept first completes the work that is due by the current time
// (realtime: by the wall clock), and calls that enqueue do so again afterwards, so an op of zero
// duration on an idle stream has completed when the call returns. Kernel effects therefore run on
// whichever thread's call reaches their end time. Memory calls never run effects: the driver
// latencies (sim_config) only move the clock, and the next call completes what that made due.
#include "spillway/sim_device.hpp"

#include <array>
#include <mutex>
#include <string>

#include "sim_memory.hpp"
#include "sim_scheduler.hpp"
#include "spillway/errors.hpp"

namespace spillway {
namespace {

// Fault injection: a countdown per site; the call that brings it to zero fails.
class fault_plan {
 public:
  void fail_nth(fault_site site, std::uint64_t n) noexcept { countdown_[index(site)] = n; }
  void clear() noexcept { countdown_.fill(0); }

  bool should_fail(fault_site site, sim_counters& counters) noexcept {
    std::uint64_t& left = countdown_[index(site)];
    if (left == 0 || --left > 0) return false;
    ++counters.faults_injected;
    return true;
  }

 private:
  static std::size_t index(fault_site site) noexcept { return static_cast<std::size_t>(site); }
  std::array<std::uint64_t, 4> countdown_{};
};

sim_config checked(const sim_config& config) {
  auto bad = [](const std::string& what) {
    throw invalid_argument("sim_device: " + what);
  };
  if (!(config.h2d_bandwidth > 0) || !(config.d2h_bandwidth > 0) || !(config.d2d_bandwidth > 0))
    bad("bandwidths must be positive (h2d " + std::to_string(config.h2d_bandwidth) + ", d2h " +
        std::to_string(config.d2h_bandwidth) + ", d2d " + std::to_string(config.d2d_bandwidth) +
        " bytes/s)");
  if (!(config.time_scale > 0)) bad("time_scale " + std::to_string(config.time_scale) + " must be positive");
  return config;
}

bool valid_kind(copy_kind kind) noexcept {
  switch (kind) {
    case copy_kind::host_to_device:
    case copy_kind::device_to_host:
    case copy_kind::device_to_device:
    case copy_kind::host_to_host:
      return true;
  }
  return false;
}

}  // namespace

struct sim_device::state {
  explicit state(const sim_config& c)
      : config(checked(c)), name("sim:" + std::to_string(config.device_index)),
        memory(config, counters, name), scheduler(config, counters, name) {}

  const sim_config config;
  const std::string name;
  mutable std::mutex mutex;
  sim_counters counters;
  fault_plan faults;
  detail::sim_memory memory;
  detail::sim_scheduler scheduler;
};

using lock_type = std::unique_lock<std::mutex>;

sim_device::sim_device(sim_config config) : state_(std::make_unique<state>(config)) {}
sim_device::~sim_device() = default;  // sim_memory unmaps what is left

// --- identity --------------------------------------------------------------------------------------

int sim_device::device_index() const noexcept { return state_->config.device_index; }
std::string sim_device::name() const { return state_->name; }
std::size_t sim_device::total_memory() const { return state_->config.capacity; }

std::size_t sim_device::free_memory() const {
  std::lock_guard lock(state_->mutex);
  return state_->config.capacity - state_->counters.used_bytes;
}

const sim_config& sim_device::config() const noexcept { return state_->config; }

// --- plain segments --------------------------------------------------------------------------------

void* sim_device::reserve_segment(std::size_t bytes) {
  if (bytes == 0)
    throw invalid_argument("reserve_segment on " + state_->name + ": size 0; expected at least 1 byte");
  std::lock_guard lock(state_->mutex);
  if (state_->faults.should_fail(fault_site::segment_reservation, state_->counters)) return nullptr;
  void* ptr = state_->memory.reserve_segment(bytes);
  if (ptr != nullptr) state_->scheduler.skip_clock(state_->config.segment_reserve_latency_ns);
  return ptr;
}

void sim_device::release_segment(void* ptr, std::size_t) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard lock(state_->mutex);
  // The driver's time for a release that was made; one refused (not a live segment) costs none.
  if (state_->memory.release_segment(ptr)) state_->scheduler.skip_clock(state_->config.segment_reserve_latency_ns);
}

void sim_device::synchronize_device() {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.synchronize_device_releasing_lock(lock);
  state_->scheduler.skip_clock(state_->config.device_sync_latency_ns);
}

// --- virtual memory --------------------------------------------------------------------------------

std::size_t sim_device::vmm_granularity() const noexcept { return state_->config.vmm_granularity; }

void* sim_device::reserve_address_range(std::size_t bytes) {
  std::lock_guard lock(state_->mutex);
  return state_->memory.reserve_address_range(bytes);
}

void sim_device::release_address_range(void* base, std::size_t) noexcept {
  std::lock_guard lock(state_->mutex);
  state_->memory.release_address_range(base);
}

bool sim_device::map_physical(void* addr, std::size_t bytes) {
  std::lock_guard lock(state_->mutex);
  state_->memory.check_map(addr, bytes);  // misuse throws before a fault is spent on it
  if (state_->faults.should_fail(fault_site::page_map, state_->counters)) return false;
  if (!state_->memory.map(addr, bytes)) return false;
  state_->scheduler.skip_clock(state_->config.page_map_latency_ns);
  return true;
}

void sim_device::unmap_physical(void* addr, std::size_t bytes) noexcept {
  std::lock_guard lock(state_->mutex);
  if (state_->memory.unmap(addr, bytes) > 0) state_->scheduler.skip_clock(state_->config.page_map_latency_ns);
}

// --- streams and events ----------------------------------------------------------------------------

stream_ref sim_device::create_stream() {
  std::lock_guard lock(state_->mutex);
  return stream_ref{state_->scheduler.create_stream()};
}

void sim_device::destroy_stream(stream_ref s) noexcept {
  std::lock_guard lock(state_->mutex);
  state_->scheduler.destroy_stream(s.value);
}

void sim_device::synchronize_stream(stream_ref s) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.synchronize_stream_releasing_lock(lock, s.value);
}

event_ref sim_device::create_event() {
  std::lock_guard lock(state_->mutex);
  return event_ref{state_->scheduler.create_event()};
}

void sim_device::destroy_event(event_ref e) noexcept {
  std::lock_guard lock(state_->mutex);
  state_->scheduler.destroy_event(e.value);
}

void sim_device::record_event(event_ref e, stream_ref s) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.enqueue_record(e.value, s.value);
  state_->scheduler.catch_up_releasing_lock(lock);
}

bool sim_device::event_completed(event_ref e) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);  // manual mode: completes only what is due now
  return state_->scheduler.event_completed(e.value);
}

void sim_device::synchronize_event(event_ref e) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.synchronize_event_releasing_lock(lock, e.value);
}

void sim_device::stream_wait_event(stream_ref s, event_ref e) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.enqueue_wait(s.value, e.value);
  state_->scheduler.catch_up_releasing_lock(lock);
}

// --- copies ----------------------------------------------------------------------------------------

void sim_device::copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                            stream_ref s) {
  const std::string& name = state_->name;
  if (!valid_kind(kind))
    throw invalid_argument("copy_async on " + name + ": unknown copy_kind " +
                           std::to_string(static_cast<int>(kind)));
  if (bytes > 0 && (dst == nullptr || src == nullptr))
    throw invalid_argument("copy_async(" + format_bytes(bytes) + ") on " + name + ": " +
                           (dst == nullptr ? "dst" : "src") + " is nullptr");
  lock_type lock(state_->mutex);
  state_->scheduler.check_stream(s.value, "copy_async");
  if (state_->faults.should_fail(fault_site::copy, state_->counters))
    throw device_error("copy_async(" + format_bytes(bytes) + ") on " + name +
                       " failed: injected fault (fault_site::copy); nothing was enqueued");
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.enqueue_copy(dst, src, bytes, kind, s.value);
  state_->scheduler.catch_up_releasing_lock(lock);
}

// --- pinned host memory ----------------------------------------------------------------------------

void* sim_device::allocate_pinned_host(std::size_t bytes) {
  if (bytes == 0)
    throw invalid_argument("allocate_pinned_host on " + state_->name +
                           ": size 0; expected at least 1 byte");
  std::lock_guard lock(state_->mutex);
  if (state_->faults.should_fail(fault_site::pinned_host_allocation, state_->counters)) return nullptr;
  return state_->memory.allocate_pinned(bytes);
}

void sim_device::free_pinned_host(void* ptr, std::size_t) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard lock(state_->mutex);
  state_->memory.free_pinned(ptr);
}

// --- simulation ------------------------------------------------------------------------------------

void sim_device::launch(stream_ref s, std::uint64_t duration_ns, std::function<void()> effect) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.enqueue_kernel(s.value, duration_ns, std::move(effect));
  state_->scheduler.catch_up_releasing_lock(lock);
}

std::uint64_t sim_device::now_ns() const {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  return state_->scheduler.now();
}

void sim_device::advance(std::uint64_t ns) {
  lock_type lock(state_->mutex);
  state_->scheduler.advance_releasing_lock(lock, ns);
}

void sim_device::run_until_idle() {
  lock_type lock(state_->mutex);
  state_->scheduler.run_until_idle_releasing_lock(lock);
}

void sim_device::hold(stream_ref s) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);  // what already ended stays completed
  state_->scheduler.hold(s.value);
}

void sim_device::release(stream_ref s) {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  state_->scheduler.release(s.value);
  state_->scheduler.catch_up_releasing_lock(lock);
}

bool sim_device::stream_idle(stream_ref s) const {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  return state_->scheduler.stream_idle(s.value);
}

void sim_device::fail_nth(fault_site site, std::uint64_t n) {
  if (static_cast<unsigned>(site) > static_cast<unsigned>(fault_site::copy))
    throw invalid_argument("fail_nth on " + state_->name + ": unknown fault_site " +
                           std::to_string(static_cast<int>(site)));
  std::lock_guard lock(state_->mutex);
  state_->faults.fail_nth(site, n);
}

void sim_device::clear_faults() {
  std::lock_guard lock(state_->mutex);
  state_->faults.clear();
}

sim_counters sim_device::counters() const {
  lock_type lock(state_->mutex);
  state_->scheduler.catch_up_releasing_lock(lock);
  return state_->counters;
}

}  // namespace spillway
