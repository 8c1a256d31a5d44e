// libtorch_activations: spillway.activations() and spillway.checkpoint for LibTorch C++ programs.
//
//   spillway::torch_plugin::enable_libtorch_hooks();        // once, before the first backward
//   auto manager = activation_manager::make({.max_resident = 1 << 30});
//   {
//     activation_scope scope(manager);                      // saved tensors go to the manager
//     auto h = checkpoint([&](const auto& in) { return block->forward(in[0]); }, {x});
//     loss = head->forward(h).sum();
//   }
//   loss.backward();
//
// The mechanism. LibTorch has no saved_tensors_hooks without Python: at::SavedTensorDefaultHooks
// holds Python objects. But every SavedVariable asks the default autograd engine for its hooks
// (Engine::get_default_saved_variable_hooks, virtual), and the default engine is replaceable
// (torch::autograd::set_default_engine_stub; PyTorch's Python engine is installed that way).
// enable_libtorch_hooks() installs an engine that differs from the base one only there: on a
// thread inside an activation_scope, a tensor saved for backward is packed by the scope's
// activation_manager (activation_manager.hpp) and unpacked through it.
//
// Contract
// - enable_libtorch_hooks() must run before the first backward and never in a process with Python
//   autograd (it would replace PyTorch's Python engine): it throws std::logic_error if the default
//   engine is not the base engine. Calling it again is a no-op.
// - activation_scope is per thread and nests (the innermost wins). Without enable_libtorch_hooks()
//   a scope registers nothing.
// - checkpoint(fn, inputs, keep) runs fn(inputs) as a segment of the current scope's manager: its
//   saved storages may be dropped under pressure and are recomputed by running fn again on
//   detached copies of the inputs (same requires_grad), with the RNG state of the first run; the
//   tensors in `keep` (for example BatchNorm running_mean, running_var, num_batches_tracked) are
//   put back after the replay so that it does not update them twice. fn may run a backward of its
//   own (a gradient penalty): the replay runs it too, on what the replay saved. Outside a scope it
//   is fn(inputs).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "activation_manager.hpp"

namespace spillway::torch_plugin {

void enable_libtorch_hooks();

class activation_scope {
 public:
  explicit activation_scope(std::shared_ptr<activation_manager> manager);
  ~activation_scope();  // enforces max_resident on what the last packs could not evict yet
  activation_scope(const activation_scope&) = delete;
  activation_scope& operator=(const activation_scope&) = delete;

  static activation_manager* current() noexcept;

 private:
  std::shared_ptr<activation_manager> manager_;
  activation_scope* outer_;
};

using segment_function = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

at::Tensor checkpoint(const segment_function& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& keep = {});

}  // namespace spillway::torch_plugin
