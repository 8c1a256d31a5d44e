// plugin_backends.cpp: make_backends. The contract is in plugin_backends.hpp.
#include "plugin_backends.hpp"

#include <memory>

#include "spillway/errors.hpp"
#include "spillway/sim_device.hpp"

#if SPILLWAY_WITH_CUDA
#include "spillway/cuda_device.hpp"
#endif

namespace spillway {

backend_set make_backends(const plugin_config& config) {
  if (config.backend == "sim") {
    sim_config sim;
    sim.capacity = config.sim_capacity;
    return {1, [sim](int index) {
              sim_config c = sim;
              c.device_index = index;
              return std::make_shared<sim_device>(c);
            }};
  }
  if (config.backend == "cuda") {
#if SPILLWAY_WITH_CUDA
    const int count = cuda_device_count();
    if (count == 0) {
      throw device_error("spillway: backend cuda: no usable CUDA device (" + cuda_unavailable_reason() +
                         "); SPILLWAY_CONF=backend:sim selects the simulated device");
    }
    return {count, [](int index) { return make_cuda_device(index); }};
#else
    throw device_error("spillway: backend cuda: this spillway was built without CUDA; "
                       "SPILLWAY_CONF=backend:sim selects the simulated device");
#endif
  }
  throw invalid_argument("spillway: unknown backend \"" + config.backend + "\": expected cuda or sim");
}

std::unique_ptr<plugin_allocator> make_plugin_allocator(plugin_config config,
                                                        device_observers observers) {
  backend_set backends = make_backends(config);
  return std::make_unique<plugin_allocator>(std::move(config), backends.device_count,
                                            std::move(backends.make), std::move(observers));
}

}  // namespace spillway
