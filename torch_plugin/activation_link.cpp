// activation_link.cpp: the contract is in activation_link.hpp.
#include "activation_link.hpp"

#include <algorithm>
#include <cmath>

namespace spillway::torch_plugin {

void link_meter::sample(link_direction d, std::size_t bytes, double seconds) noexcept {
  if (bytes == 0 || !(seconds >= 0) || !std::isfinite(seconds)) return;
  estimate& e = d == link_direction::to_host ? to_host_ : to_device_;
  e.bytes = decay * e.bytes + static_cast<double>(bytes);
  // A copy within the clock's resolution counts a nanosecond: the estimate stays finite.
  e.seconds = decay * e.seconds + std::max(seconds, 1e-9);
}

double link_meter::bytes_per_s(link_direction d) const noexcept {
  const estimate& e = of(d);
  return fixed_ || e.seconds <= 0 ? configured_ : e.bytes / e.seconds;
}

void link_meter::reserve_device(int device) {
  if (device >= 0 && static_cast<std::size_t>(device) >= queued_.size()) {
    queued_.resize(static_cast<std::size_t>(device) + 1, 0);
  }
}

void link_meter::copy_queued(int device, std::size_t bytes) noexcept {
  if (device >= 0 && static_cast<std::size_t>(device) < queued_.size()) queued_[device] += bytes;
}

void link_meter::copy_done(int device, std::size_t bytes) noexcept {
  if (device >= 0 && static_cast<std::size_t>(device) < queued_.size()) {
    queued_[device] -= std::min(queued_[device], bytes);
  }
}

std::size_t link_meter::queued_bytes(int device) const noexcept {
  return device >= 0 && static_cast<std::size_t>(device) < queued_.size() ? queued_[device] : 0;
}

double link_meter::spill_seconds(std::size_t bytes, int device) const noexcept {
  const double out = static_cast<double>(queued_bytes(device) + bytes) /
                     bytes_per_s(link_direction::to_host);
  return out + static_cast<double>(bytes) / bytes_per_s(link_direction::to_device);
}

}  // namespace spillway::torch_plugin
