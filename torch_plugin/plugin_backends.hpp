// plugin_backends: the devices a plugin_config names.
//
// - backend "sim": one simulated device, index 0, of config.sim_capacity bytes, manual clock (the
//   only work it sees is the allocator's own event records, which complete when enqueued).
// - backend "cuda": every CUDA device the process sees (make_cuda_device, created on first use by
//   plugin_allocator). No usable device is device_error naming the reason; so is "cuda" in a build
//   without CUDA.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "config_string.hpp"
#include "plugin_allocator.hpp"

namespace spillway {

struct backend_set {
  int device_count = 0;
  backend_factory make;
};

backend_set make_backends(const plugin_config& config);

// A plugin_allocator over the devices make_backends(config) names. Throws what make_backends throws.
std::unique_ptr<plugin_allocator> make_plugin_allocator(plugin_config config,
                                                        device_observers observers = {});

}  // namespace spillway
