// backend_fixture: runs one test body against every device backend.
//
//   TEST_CASE_TEMPLATE("...", B, SPILLWAY_ALL_BACKENDS) {
//     SPILLWAY_BACKEND_OR_SKIP(B, env);   // backend_env& env, or the case passes after a MESSAGE
//     device_allocator alloc(env.backend, env.config());
//     ...
//   }
//
// - sim_backend: a sim_device with a manual clock (2 GiB capacity). Always available. Its device
//   pointers are host memory, so tests may write and check bytes through them (env.host_bytes()).
// - cuda_backend: device 0 of the CUDA backend when spillway is built with CUDA
//   (SPILLWAY_WITH_CUDA) and a device exists. Otherwise the case prints
//   "SKIPPED: no CUDA device: <reason>" and passes.
//
// Declare the env before the allocator: the allocator is then destroyed first, and the streams the
// env created outlive every event the allocator recorded on them.
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spillway/allocator_config.hpp"
#include "spillway/device_backend.hpp"
#include "spillway/sim_device.hpp"
#if SPILLWAY_WITH_CUDA
#include "spillway/cuda_device.hpp"
#endif

namespace spillway::test {

// Collects on_warning messages (thread-safe); the allocator keeps a copy of the sink, so the
// storage is shared.
class warning_log {
 public:
  std::function<void(const std::string&)> sink() const {
    auto s = state_;
    return [s](const std::string& message) {
      std::lock_guard lock(s->mutex);
      s->messages.push_back(message);
    };
  }
  std::vector<std::string> messages() const {
    std::lock_guard lock(state_->mutex);
    return state_->messages;
  }
  std::size_t size() const { return messages().size(); }
  void clear() {
    std::lock_guard lock(state_->mutex);
    state_->messages.clear();
  }

 private:
  struct state {
    mutable std::mutex mutex;
    std::vector<std::string> messages;
  };
  std::shared_ptr<state> state_ = std::make_shared<state>();
};

struct backend_env {
  std::shared_ptr<device_backend> backend;
  sim_device* sim = nullptr;  // the sim backend only
  warning_log warnings;
  std::vector<stream_ref> streams;

  backend_env() = default;
  backend_env(const backend_env&) = delete;
  backend_env& operator=(const backend_env&) = delete;
  ~backend_env() {
    try {
      backend->synchronize_device();
    } catch (...) {
    }
    for (stream_ref s : streams) backend->destroy_stream(s);
  }

  stream_ref new_stream() {
    const stream_ref s = backend->create_stream();
    streams.push_back(s);
    return s;
  }
  // Device pointers are host memory that the test may read and write (the sim).
  bool host_bytes() const noexcept { return sim != nullptr; }
  // A config whose warnings land in `warnings`.
  allocator_config config() const {
    allocator_config c;
    c.on_warning = warnings.sink();
    return c;
  }
  // config() with expandable segments over a 256 MiB address range, under `budget` bytes.
  allocator_config expandable_config(std::size_t budget) const {
    allocator_config c = config();
    c.expandable_segments = true;
    c.expandable_address_range = std::size_t{256} << 20;
    c.budget = budget;
    return c;
  }
};

inline sim_config default_sim_config() {
  sim_config c;
  c.capacity = std::size_t{2} << 30;
  c.clock = clock_mode::manual;
  return c;
}

inline std::unique_ptr<backend_env> make_sim_env(const sim_config& config = default_sim_config()) {
  auto env = std::make_unique<backend_env>();
  auto sim = std::make_shared<sim_device>(config);
  env->sim = sim.get();
  env->backend = std::move(sim);
  return env;
}

struct sim_backend {
  static std::unique_ptr<backend_env> make(std::string& /*skip_reason*/) { return make_sim_env(); }
};

struct cuda_backend {
  static std::unique_ptr<backend_env> make(std::string& skip_reason) {
#if SPILLWAY_WITH_CUDA
    if (cuda_device_count() == 0) {
      skip_reason = "no CUDA device: " + cuda_unavailable_reason();
      return nullptr;
    }
    auto env = std::make_unique<backend_env>();
    env->backend = make_cuda_device(0);
    return env;
#else
    skip_reason = "no CUDA device: spillway was built without CUDA (SPILLWAY_WITH_CUDA=OFF)";
    return nullptr;
#endif
  }
};

}  // namespace spillway::test

TYPE_TO_STRING(spillway::test::sim_backend);
TYPE_TO_STRING(spillway::test::cuda_backend);

#define SPILLWAY_ALL_BACKENDS spillway::test::sim_backend, spillway::test::cuda_backend

// Declares `backend_env& env` for backend type B, or ends the test case (passing) with a message.
#define SPILLWAY_BACKEND_OR_SKIP(B, env)                                   \
  std::string env##_skip_reason;                                           \
  std::unique_ptr<spillway::test::backend_env> env##_owner =               \
      B::make(env##_skip_reason);                                          \
  if (!env##_owner) {                                                      \
    MESSAGE("SKIPPED: " << env##_skip_reason);                             \
    return;                                                                \
  }                                                                        \
  spillway::test::backend_env& env = *env##_owner
