// activation_link: the host link as the activation managers see it, for their choice per storage
// between spilling it and dropping it (activation_manager.hpp, "by cost").
//
// Contract
// - link_estimates: each link's bandwidth, per device (a CUDA device's index; -1 for CPU
//   storages, whose copies go from host memory to host memory) and direction (to host: spills;
//   to the device: restores), from the copies measured on it: sample(device, direction, bytes,
//   seconds). The estimate is the bytes over the seconds of the copies so far, each earlier copy
//   weighing `decay` less at every new one (a link whose speed changes, or a first copy that paid
//   for page faults, is forgotten in a few dozen copies); a large copy weighs more than a small
//   one, whose time is mostly latency. nullopt until a link's first sample. process() is the one
//   set every manager shares: a link's speed is the machine's, and a manager made for each step
//   starts from what the earlier ones measured. Thread-safe. A device index past max_devices is
//   never measured.
// - link_meter: one manager's view of them. bytes_per_s: the configured bandwidth when
//   constructed `fixed` (a user who states the link's speed means it) or until the link has a
//   sample, else the shared estimate; samples go to the shared estimates either way. Occupancy:
//   the bytes of the manager's copies to host memory that hold a device's copy engine (their wait
//   for the compute stream is over and they have not completed), as last counted
//   (set_occupied), plus those queued since (copy_queued): a spill made now waits behind them.
//   spill_seconds(bytes, device) = (occupied + bytes) / to-host + bytes / to-device: the spill's
//   wait and copy out, then the copy back. reserve_device(device) before copy_queued or
//   set_occupied, which never allocate or throw. Not thread-safe: the manager's lock guards it.
#pragma once

#include <array>
#include <cstddef>
#include <mutex>
#include <optional>
#include <vector>

namespace spillway::torch_plugin {

enum class link_direction { to_host, to_device };

class link_estimates {
 public:
  static constexpr double decay = 0.9;
  static constexpr int max_devices = 128;  // CUDA device indices below it are measured

  void sample(int device, link_direction d, std::size_t bytes, double seconds) noexcept;
  std::optional<double> bytes_per_s(int device, link_direction d) const noexcept;

  static link_estimates& process() noexcept;

 private:
  struct estimate {
    double bytes = 0, seconds = 0;  // decayed sums over the samples
  };
  static std::optional<std::size_t> index(int device, link_direction d) noexcept;

  mutable std::mutex mutex_;
  std::array<estimate, 2 * (max_devices + 1)> estimates_{};
};

class link_meter {
 public:
  link_meter(double configured_bytes_per_s, bool fixed,
             link_estimates& shared = link_estimates::process()) noexcept
      : configured_(configured_bytes_per_s), fixed_(fixed), shared_(&shared) {}

  void sample(int device, link_direction d, std::size_t bytes, double seconds) noexcept {
    shared_->sample(device, d, bytes, seconds);
  }
  double bytes_per_s(int device, link_direction d) const noexcept;

  void reserve_device(int device);  // may throw std::bad_alloc
  void copy_queued(int device, std::size_t bytes) noexcept;
  void set_occupied(int device, std::size_t bytes) noexcept;
  std::size_t occupied_bytes(int device) const noexcept;
  std::size_t devices() const noexcept { return occupied_.size(); }  // those reserved

  double spill_seconds(std::size_t bytes, int device) const noexcept;

 private:
  double configured_;
  bool fixed_;
  link_estimates* shared_;
  std::vector<std::size_t> occupied_;  // by CUDA device index
};

}  // namespace spillway::torch_plugin
