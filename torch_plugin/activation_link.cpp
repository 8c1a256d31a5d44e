// activation_link.cpp: the contract is in activation_link.hpp.
#include "activation_link.hpp"

#include <algorithm>
#include <cmath>

namespace spillway::torch_plugin {

std::optional<std::size_t> link_estimates::index(int device, link_direction d) noexcept {
  if (device < -1 || device >= max_devices) return std::nullopt;
  return static_cast<std::size_t>(device + 1) * 2 + (d == link_direction::to_host ? 0 : 1);
}

void link_estimates::sample(int device, link_direction d, std::size_t bytes,
                            double seconds) noexcept {
  const std::optional<std::size_t> i = index(device, d);
  if (!i || bytes == 0 || !(seconds >= 0) || !std::isfinite(seconds)) return;
  std::lock_guard lock(mutex_);
  estimate& e = estimates_[*i];
  e.bytes = decay * e.bytes + static_cast<double>(bytes);
  // A copy within the clock's resolution counts a nanosecond: the estimate stays finite.
  e.seconds = decay * e.seconds + std::max(seconds, 1e-9);
}

std::optional<double> link_estimates::bytes_per_s(int device, link_direction d) const noexcept {
  const std::optional<std::size_t> i = index(device, d);
  if (!i) return std::nullopt;
  std::lock_guard lock(mutex_);
  const estimate& e = estimates_[*i];
  if (e.seconds <= 0) return std::nullopt;
  return e.bytes / e.seconds;
}

link_estimates& link_estimates::process() noexcept {
  static link_estimates& shared = *new link_estimates;  // never destroyed: used at exit too
  return shared;
}

double link_meter::bytes_per_s(int device, link_direction d) const noexcept {
  if (fixed_) return configured_;
  return shared_->bytes_per_s(device, d).value_or(configured_);
}

void link_meter::reserve_device(int device) {
  if (device >= 0 && static_cast<std::size_t>(device) >= occupied_.size()) {
    occupied_.resize(static_cast<std::size_t>(device) + 1, 0);
  }
}

void link_meter::copy_queued(int device, std::size_t bytes) noexcept {
  if (device >= 0 && static_cast<std::size_t>(device) < occupied_.size()) {
    occupied_[device] += bytes;
  }
}

void link_meter::set_occupied(int device, std::size_t bytes) noexcept {
  if (device >= 0 && static_cast<std::size_t>(device) < occupied_.size()) {
    occupied_[device] = bytes;
  }
}

std::size_t link_meter::occupied_bytes(int device) const noexcept {
  return device >= 0 && static_cast<std::size_t>(device) < occupied_.size() ? occupied_[device] : 0;
}

double link_meter::spill_seconds(std::size_t bytes, int device) const noexcept {
  const double out = static_cast<double>(occupied_bytes(device) + bytes) /
                     bytes_per_s(device, link_direction::to_host);
  return out + restore_seconds(bytes, device);
}

double link_meter::restore_seconds(std::size_t bytes, int device) const noexcept {
  return static_cast<double>(bytes) / bytes_per_s(device, link_direction::to_device);
}

}  // namespace spillway::torch_plugin
