// libtorch_activations.cpp: the contract is in libtorch_activations.hpp.
#include "libtorch_activations.hpp"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <typeinfo>
#include <mutex>
#include <optional>
#include <stdexcept>

namespace spillway::torch_plugin {

namespace {

thread_local activation_scope* innermost = nullptr;

// The autocast state a segment runs under, per device type and the cache. Its replay runs in
// backward, outside the first run's autocast: it must cast as that run did, or it computes other
// bytes (another dtype: a size mismatch; the same size: silently different values).
struct autocast_state {
  static constexpr std::array<at::DeviceType, 2> devices{at::kCPU, at::kCUDA};
  std::array<bool, 2> enabled{};
  std::array<at::ScalarType, 2> dtype{};
  bool cache = true;
  static autocast_state now() {
    autocast_state s;
    for (std::size_t i = 0; i < devices.size(); ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(devices[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(devices[i]);
    }
    s.cache = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void set() const {
    for (std::size_t i = 0; i < devices.size(); ++i) {
      at::autocast::set_autocast_enabled(devices[i], enabled[i]);
      at::autocast::set_autocast_dtype(devices[i], dtype[i]);
    }
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

// Puts `state` in force for a scope, as a nest of torch.autocast blocks would, and the state it
// found back after it (its cast cache cleared when the outermost autocast scope ends).
class autocast_scope {
 public:
  explicit autocast_scope(const autocast_state& state) : before_(autocast_state::now()) {
    state.set();
    at::autocast::increment_nesting();
  }
  ~autocast_scope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    before_.set();
  }
  autocast_scope(const autocast_scope&) = delete;
  autocast_scope& operator=(const autocast_scope&) = delete;

 private:
  autocast_state before_;
};

// While a checkpoint segment is replayed on this thread, what it saves is collected here instead,
// up to `stop_after` saves (segment_replay), where the pack hook throws replay_stopped (and again
// at every later pack, should the segment's code catch it).
struct replay_recording {
  std::vector<at::Tensor>& saved;
  std::optional<std::size_t> stop_after;
  bool stopped = false;
};
// A std::exception, so that the autograd engine's handlers take it like any error should it be
// thrown inside a backward the segment runs.
struct replay_stopped : std::exception {
  const char* what() const noexcept override {
    return "spillway: a checkpoint segment's replay stopped early (not an error)";
  }
};
thread_local replay_recording* replay_record = nullptr;

// Sets replay_record for one replay and puts back the one it found (a replay in a replay).
class recording_scope {
 public:
  explicit recording_scope(replay_recording& r) : outer_(replay_record) { replay_record = &r; }
  ~recording_scope() { replay_record = outer_; }
  recording_scope(const recording_scope&) = delete;
  recording_scope& operator=(const recording_scope&) = delete;

 private:
  replay_recording* outer_;
};

// Packs into `manager`; with no manager (a replay), only records.
class spillway_saved_hooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit spillway_saved_hooks(std::shared_ptr<activation_manager> manager)
      : manager_(std::move(manager)) {}

  void call_pack_hook(const at::Tensor& tensor) override {
    if (replay_record != nullptr) {
      // Recorded, and kept for a backward the segment runs itself (a gradient penalty): the
      // replay's graph goes when the replay returns (its output is detached), and this with it.
      if (replay_record->stopped) throw replay_stopped{};
      kept_ = tensor.detach();
      replay_record->saved.push_back(kept_);
      if (replay_record->saved.size() == replay_record->stop_after) {
        replay_record->stopped = true;
        throw replay_stopped{};
      }
      return;
    }
    if (!manager_) {
      kept_ = tensor.detach();
      return;
    }
    handle_ = manager_->pack(tensor);
    // Small: kept as it is, detached (a saved output comes with its grad_fn: the node would hold
    // itself through it, and never be freed).
    if (!handle_) kept_ = tensor.detach();
  }

  at::Tensor call_unpack_hook() override { return handle_ ? manager_->unpack(*handle_) : kept_; }

 private:
  std::shared_ptr<activation_manager> manager_;
  std::shared_ptr<activation_manager::saved> handle_;
  at::Tensor kept_;
};

// The base engine, except for the saved variables of threads inside an activation_scope.
class spillway_engine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    // A replay runs inside an unpack, possibly on an autograd worker thread outside any scope.
    if (replay_record != nullptr) return std::make_unique<spillway_saved_hooks>(nullptr);
    activation_manager* m = activation_scope::current();
    if (m == nullptr) return nullptr;
    return std::make_unique<spillway_saved_hooks>(m->shared_from_this());
  }
};

torch::autograd::Engine& spillway_engine_instance() {
  static auto* engine = new spillway_engine;  // never destroyed, like the base engine
  return *engine;
}

}  // namespace

void enable_libtorch_hooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& current = torch::autograd::Engine::get_default_engine();
    if (typeid(current) != typeid(torch::autograd::Engine)) {
      throw std::logic_error(
          "spillway: enable_libtorch_hooks: the default autograd engine is not LibTorch's base "
          "engine (a Python process?); use spillway.activations() from Python instead");
    }
    torch::autograd::set_default_engine_stub(&spillway_engine_instance);
  });
}

activation_scope::activation_scope(std::shared_ptr<activation_manager> manager)
    : manager_(std::move(manager)), outer_(innermost) {
  innermost = this;
}

activation_scope::~activation_scope() {
  innermost = outer_;
  try {
    manager_->end_scope();
  } catch (...) {
    // A destructor cannot fail; the next pack or unpack enforces it again.
  }
}

activation_manager* activation_scope::current() noexcept {
  return innermost == nullptr ? nullptr : innermost->manager_.get();
}

at::Tensor checkpoint(const segment_function& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& keep) {
  activation_manager* manager = activation_scope::current();
  // Outside a scope it is fn; inside a replay too: the replay records what fn saves, and a
  // segment opened by it would hold its inputs as entries for nothing.
  if (manager == nullptr || replay_record != nullptr) return fn(inputs);

  std::vector<c10::DeviceIndex> cuda_devices;
  for (const at::Tensor& t : inputs) {
    if (t.defined() && t.is_cuda() &&
        std::find(cuda_devices.begin(), cuda_devices.end(), t.device().index()) == cuda_devices.end()) {
      cuda_devices.push_back(t.device().index());
    }
  }
  // The inputs are the manager's to hold (evictable, and handed back resident): not captured.
  std::vector<bool> requires_grad;
  for (const at::Tensor& t : inputs) requires_grad.push_back(t.defined() && t.requires_grad());
  segment_replay replay = [fn, requires_grad, keep, cast = autocast_state::now()](
                              const std::vector<at::Tensor>& resident,
                              std::optional<std::size_t> stop_after) {
    std::vector<at::Tensor> kept_values;
    for (const at::Tensor& t : keep) kept_values.push_back(t.detach().clone());
    // `keep` is put back however the replay ends (a stop, an error, out of memory).
    struct kept_back {
      const std::vector<at::Tensor>& keep;
      const std::vector<at::Tensor>& values;
      ~kept_back() {
        at::NoGradGuard no_grad;
        try {
          for (std::size_t i = 0; i < keep.size(); ++i) keep[i].detach().copy_(values[i]);
        } catch (...) {  // a destructor cannot fail: a copy of the state that failed stays as the replay left it
        }
      }
    } put_back{keep, kept_values};
    const autocast_scope casting(cast);  // backward runs it outside the first run's autocast
    std::vector<at::Tensor> detached;
    for (std::size_t i = 0; i < resident.size(); ++i) {
      const at::Tensor& t = resident[i];
      detached.push_back(t.defined() ? t.detach().requires_grad_(requires_grad[i]) : t);
    }
    segment_run run;
    replay_recording recording{run.saved, stop_after};
    try {
      recording_scope recording_on(recording);
      at::AutoGradMode grad(true);
      run.outputs.push_back(fn(detached).detach());  // without the replay's graph
    } catch (...) {
      // Once stopped, however the run ended (the stop, or an error made of it), it is a stop;
      // what it ran so far goes with the stack it unwound.
      if (!recording.stopped) throw;
    }
    if (recording.stopped) {  // also when fn caught the stop and returned: nothing recorded since
      run.stopped = true;
      run.outputs.clear();
    }
    return run;
  };
  manager->begin_segment(std::move(replay), std::move(cuda_devices), inputs);
  const auto start = std::chrono::steady_clock::now();
  // Its output, so that the next segment's input (or a save after it) can be dropped and
  // recomputed by this one's replay. Whatever fails before end_segment (the run, or host memory
  // for the list) ends the segment too: an open one would be every later save's lineage.
  std::vector<at::Tensor> outputs;
  try {
    outputs.push_back(fn(inputs));
  } catch (...) {
    manager->end_segment(0);
    throw;
  }
  manager->end_segment(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                       outputs);
  return outputs.front();
}

}  // namespace spillway::torch_plugin
