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
//   the bytes of the manager's copies to host memory that hold a device's copy engine (those
//   ahead of its first copy still waiting for the compute stream, not complete), as last counted
//   (set_occupied, by scan_copies), plus those queued since (copy_queued): a spill made now waits
//   behind them. Other managers' copies on the same stream are not counted.
//   spill_seconds(bytes, device) = (occupied + bytes) / to-host + bytes / to-device: the spill's
//   wait and copy out, then the copy back; restore_seconds(bytes, device) = bytes / to-device:
//   the copy back alone (a storage whose host copy is kept). reserve_device(device) before copy_queued or
//   set_occupied, which never allocate or throw. Not thread-safe: the manager's lock guards it.
// - scan_copies(copies, meter): a manager's timed CUDA copies (activation_spill.cpp), over any
//   event type with query() and elapsedTime(end) in milliseconds, so that it is tested without a
//   GPU. Each complete copy is a sample of its link and leaves the list; the others stay, in
//   order. Occupancy is recounted: the bytes of copies to host memory whose `ready` (the compute
//   stream's point the copy stream waits for) has completed. Every copy to host memory of a
//   device goes through one in-order stream (the process's copy stream of that device), so once
//   one copy of a (device, direction) is not complete the later ones are not asked, and once one
//   copy to host is still waiting for compute the later ones of that device are not either (they
//   queue behind it, whatever stream their own wait is on): the events asked are the copies
//   complete since the last scan and a few per device, not the whole list. `eligible` remembers
//   a wait passed. An event that throws when asked takes its copy off the list, unsampled and
//   uncounted: a scan never throws (the copies' own CUDA calls report real errors).
#pragma once

#include <array>
#include <cstddef>
#include <mutex>
#include <optional>
#include <utility>
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
  double restore_seconds(std::size_t bytes, int device) const noexcept;

 private:
  double configured_;
  bool fixed_;
  link_estimates* shared_;
  std::vector<std::size_t> occupied_;  // by CUDA device index
};

// Copy: {device (0 <= device < link_estimates::max_devices); link_direction direction;
// std::size_t bytes; Event start, end; std::optional<Event> ready; bool eligible}.
template <class Copy>
void scan_copies(std::vector<Copy>& copies, link_meter& link) noexcept {
  if (copies.empty()) return;
  constexpr std::size_t devices = link_estimates::max_devices;
  std::array<bool, 2 * devices> busy{};  // (device, direction): a copy not complete seen
  std::array<bool, devices> waiting{};   // device: a copy to host still waiting for compute seen
  std::array<std::size_t, devices> occupied{};
  std::size_t kept = 0;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    Copy& c = copies[i];
    const auto d = static_cast<std::size_t>(c.device);
    bool keep = d < devices;
    try {
      const std::size_t stream = 2 * d + (c.direction == link_direction::to_host ? 0 : 1);
      if (keep && !busy[stream]) {
        if (c.end.query()) {  // complete: sampled, and not kept
          keep = false;
          link.sample(static_cast<int>(d), c.direction, c.bytes, c.start.elapsedTime(c.end) / 1e3);
        } else {
          busy[stream] = true;
        }
      }
      if (keep && c.direction == link_direction::to_host) {
        if (!c.eligible && !waiting[d] && c.ready) {
          c.eligible = c.ready->query();
          waiting[d] = !c.eligible;
        }
        if (c.eligible) occupied[d] += c.bytes;
      }
    } catch (...) {
      keep = false;  // an event that cannot be asked: neither sampled nor counted
    }
    if (!keep) continue;
    if (kept != i) copies[kept] = std::move(c);
    ++kept;
  }
  copies.erase(copies.begin() + static_cast<std::ptrdiff_t>(kept), copies.end());
  for (std::size_t device = 0; device < link.devices() && device < devices; ++device) {
    link.set_occupied(static_cast<int>(device), occupied[device]);
  }
}

}  // namespace spillway::torch_plugin
