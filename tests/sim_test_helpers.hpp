// sim_test_helpers: what the simulated device's tests share (a small test configuration,
// error-text capture, byte patterns, an RAII segment).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "spillway/errors.hpp"
#include "spillway/sim_device.hpp"

namespace spillway::sim_test {

constexpr std::size_t k_kib = 1024;
constexpr std::size_t k_mib = 1024 * k_kib;
constexpr std::size_t k_gran = 64 * k_kib;  // a multiple of the host page size

// Manual clock, one byte per nanosecond in every direction, 100 ns copy latency.
inline sim_config test_config() {
  sim_config c;
  c.capacity = 64 * k_mib;
  c.pinned_host_capacity = 8 * k_mib;
  c.vmm_granularity = k_gran;
  c.h2d_bandwidth = 1e9;
  c.d2h_bandwidth = 1e9;
  c.d2d_bandwidth = 1e9;
  c.copy_latency_ns = 100;
  return c;
}

template <class F>
inline std::string invalid_argument_text(F&& f) {
  try {
    f();
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "<no spillway::invalid_argument>";
}

// The message of a plain std::logic_error (not an invalid_argument, which is one too).
template <class F>
inline std::string logic_error_text(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return std::string("<invalid_argument: ") + e.what() + ">";
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "<no std::logic_error>";
}

inline std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
  std::vector<std::uint8_t> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = static_cast<std::uint8_t>(i * 131 + seed);
  return v;
}

inline bool all_zero(const void* p, std::size_t bytes) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  return std::all_of(b, b + bytes, [](std::uint8_t x) { return x == 0; });
}

// A device segment released at scope exit.
struct segment {
  sim_device& dev;
  std::size_t bytes;
  void* ptr;
  segment(sim_device& d, std::size_t n) : dev(d), bytes(n), ptr(d.reserve_segment(n)) {
    REQUIRE(ptr != nullptr);
  }
  ~segment() { dev.release_segment(ptr, bytes); }
  std::uint8_t* data() const { return static_cast<std::uint8_t*>(ptr); }
};

}  // namespace spillway::sim_test
