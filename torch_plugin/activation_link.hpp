// activation_link: the host link as the activation manager sees it, for its choice per storage
// between spilling it and dropping it (activation_manager.hpp, "by cost").
//
// Contract
// - Each direction's bandwidth (to host: spills; to the device: restores) is measured from the
//   manager's own copies: sample(direction, bytes, seconds) once a copy is complete. The estimate
//   is the bytes over the seconds of the copies so far, each earlier copy weighing `decay` less at
//   every new one (a link whose speed changes, or a first copy that paid for page faults, is
//   forgotten in a few dozen copies); large copies weigh more than small ones, whose time is
//   mostly latency. Until a direction's first sample it is the configured bandwidth, and with
//   `fixed` always (a user who states the link's speed means it).
// - copy_queued / copy_done: the bytes of copies to host memory queued on a device's copy engine
//   and not complete yet (its occupancy; CUDA only: CPU copies are synchronous). A spill made now
//   waits behind them.
// - spill_seconds(bytes, device): what spilling `bytes` of `device` costs before the storage is
//   usable again: its wait behind the queued copies and its own copy out, then the copy back.
//   device -1: not a CUDA device (no queue).
// - reserve_device(device) before copy_queued: copy_queued and copy_done never allocate or throw.
// - Not thread-safe: the manager's lock guards it.
#pragma once

#include <cstddef>
#include <vector>

namespace spillway::torch_plugin {

enum class link_direction { to_host, to_device };

class link_meter {
 public:
  static constexpr double decay = 0.9;

  link_meter(double configured_bytes_per_s, bool fixed) noexcept
      : configured_(configured_bytes_per_s), fixed_(fixed) {}

  void sample(link_direction d, std::size_t bytes, double seconds) noexcept;
  double bytes_per_s(link_direction d) const noexcept;

  void reserve_device(int device);  // may throw std::bad_alloc
  void copy_queued(int device, std::size_t bytes) noexcept;
  void copy_done(int device, std::size_t bytes) noexcept;
  std::size_t queued_bytes(int device) const noexcept;

  double spill_seconds(std::size_t bytes, int device) const noexcept;

 private:
  struct estimate {
    double bytes = 0, seconds = 0;  // decayed sums over the samples
  };
  const estimate& of(link_direction d) const noexcept {
    return d == link_direction::to_host ? to_host_ : to_device_;
  }

  double configured_;
  bool fixed_;
  estimate to_host_, to_device_;
  std::vector<std::size_t> queued_;  // by device index
};

}  // namespace spillway::torch_plugin
