// plugin_allocator: the allocator behind the C ABI (libspillway_alloc.so) and the preload shim
// (libspillway_preload.so): one device_allocator per device, created on first use.
//
// Contract
// - Devices run from 0 to device_count() - 1. A device's allocator (and its backend: a CUDA context
//   for backend "cuda") is created the first time that device is used, never before: a process
//   that uses one GPU of eight touches only that one. Any other index is invalid_argument.
// - Each device gets config.allocator with the budget budget_for_device() gives it
//   (config_string.hpp) and the observers given (device_observers): warnings go to on_warning
//   (default: stderr); on_free_completed and on_segment_change, when given, are each device's
//   allocator_config observers of the same names, told the device index too.
// - allocate(device, 0, s) returns nullptr, as cudaMalloc and PyTorch's allocators do for size 0.
// - deallocate(ptr) says where ptr belongs: a live allocation of one device (freed or deferred),
//   memory spillway holds but not a live allocation (a double free: reported through on_warning,
//   nothing changes), or foreign memory (nothing is done or reported: the caller routes it to
//   whoever allocated it). nullptr is foreign.
// - memory_info(device) is what cudaMemGetInfo reports under spillway: total = min(budget, device
//   memory); free = what new allocations can still get, i.e. the budget's headroom above the
//   reserved bytes (at most what the device has free) plus the cached bytes the allocator can
//   reuse or release (reserved - allocated). free <= total. headroom is the budget's headroom
//   alone (at most what the device has free): the largest block a new segment could get.
// - Thread-safe. Created devices are never destroyed while the plugin_allocator lives.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "config_string.hpp"
#include "spillway/device_allocator.hpp"

namespace spillway {

// Makes the backend of device `index` (it must report device_index() == index).
using backend_factory = std::function<std::shared_ptr<device_backend>(int index)>;

enum class free_result {
  freed,     // returned to its pool
  deferred,  // waits on events of other streams (Note [Cross-stream frees])
  invalid,   // inside spillway's memory but not a live allocation: reported, nothing changed
  foreign,   // not spillway's memory: nothing done
};

// Told, under the device's lock, when a deallocated block may be handed out again
// (allocator_config::on_free_completed): device, pointer, requested size, stream.
using free_observer = std::function<void(int device, void* ptr, std::size_t requested_size, stream_ref stream)>;
// Told, under the device's lock, when device memory comes or goes under a segment
// (allocator_config::on_segment_change): device, what, address, bytes, the segment's stream.
using segment_observer = std::function<void(int device, segment_change what, void* address,
                                            std::size_t bytes, stream_ref stream)>;

// What a plugin_allocator tells about its devices. Each may be empty.
struct device_observers {
  std::function<void(const std::string&)> on_warning;  // empty: stderr
  free_observer on_free_completed;
  segment_observer on_segment_change;
};

struct memory_info {
  std::size_t free = 0;
  std::size_t total = 0;
  std::size_t headroom = 0;
};

class plugin_allocator {
 public:
  plugin_allocator(plugin_config config, int device_count, backend_factory make_backend,
                   device_observers observers = {});
  ~plugin_allocator();
  plugin_allocator(const plugin_allocator&) = delete;
  plugin_allocator& operator=(const plugin_allocator&) = delete;

  int device_count() const noexcept { return device_count_; }
  const plugin_config& config() const noexcept { return config_; }

  device_allocator& device(int index);                        // created on first use
  device_allocator* created_device(int index) const noexcept;  // nullptr until first use

  // A caller's CUDA stream handle as spillway's. On CUDA, cudaStreamLegacy (0x1) names the same
  // stream as NULL: one pool for both. (On the simulated device 1 is the first stream made.)
  stream_ref stream_of(const void* cuda_stream) const noexcept;

  void* allocate(int device, std::size_t bytes, stream_ref stream);
  // `holder`, when given, receives the device allocator whose memory held ptr (null if foreign).
  free_result deallocate(void* ptr, device_allocator** holder = nullptr) noexcept;
  device_allocator* owner_of(const void* ptr) const noexcept;   // the device where ptr is live
  device_allocator* holder_of(const void* ptr) const noexcept;  // the device whose memory holds ptr

  memory_info memory_info_of(int device);
  std::size_t empty_cache();  // every created device; the bytes released

  // A pressure handler on every device: those created already and those created later.
  // The id removes it from all of them.
  std::uint64_t add_pressure_handler(pressure_handler handler);
  void remove_pressure_handler(std::uint64_t id) noexcept;

 private:
  plugin_config config_;
  int device_count_;
  backend_factory make_backend_;
  device_observers observers_;
  std::mutex create_mutex_;                                   // creation only
  std::vector<std::unique_ptr<device_allocator>> owned_;      // guarded by create_mutex_
  std::unique_ptr<std::atomic<device_allocator*>[]> slots_;   // read without a lock
  struct handler_entry {
    std::uint64_t id;
    pressure_handler handler;
    std::vector<pressure_handler_id> per_device;  // by device index; 0 where not created
  };
  std::vector<handler_entry> handlers_;                      // guarded by create_mutex_
  std::uint64_t next_handler_id_ = 1;                        // guarded by create_mutex_
};

}  // namespace spillway
