// torch_allocator_fixture: a torch_allocator on the simulated device, and a tagging recorder, for
// the tests of torch_plugin/torch_allocator.hpp (test_torch_allocator, test_torch_allocator_history).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "config_string.hpp"
#include "torch_allocator.hpp"

namespace spillway::test {

namespace cca = c10::cuda::CUDACachingAllocator;
using TraceAction = c10::CachingDeviceAllocator::TraceEntry::Action;

inline constexpr std::size_t MiB = std::size_t{1} << 20;

inline torch_plugin::torch_context sim_context() {
  return {[] { return c10::DeviceIndex{0}; }, [](c10::DeviceIndex) { return stream_ref{}; }};
}

// A torch_allocator over one simulated device of 1 GiB, with `conf` (SPILLWAY_CONF keys) added.
inline std::unique_ptr<torch_plugin::torch_allocator> make(const std::string& conf = "budget:64MiB") {
  return std::make_unique<torch_plugin::torch_allocator>(
      parse_config("backend:sim,sim_capacity:1GiB," + conf), sim_context());
}

// A recorder whose contexts are numbered: next_tag is the last one handed out.
struct tagged_context : c10::GatheredContext {
  explicit tagged_context(int t) : tag(t) {}
  int tag;
};
inline int next_tag = 0;
inline std::shared_ptr<c10::GatheredContext> record_tag() {
  return std::make_shared<tagged_context>(++next_tag);
}

inline std::int64_t allocated_now(torch_plugin::torch_allocator& a) {
  return a.getDeviceStats(0).allocated_bytes[0].current;
}

}  // namespace spillway::test
