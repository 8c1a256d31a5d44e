// sim_cpu_tensors: torch's CPU tensors served from spillway's simulated device, so that a machine
// without a GPU runs a training job under a budget, with spillway.activations() evicting from
// inside allocations, the way it does on a GPU.
//
// On a GPU every tensor is spillway's memory: an operator's allocation over the budget runs the
// pressure handlers (the activation manager) in the middle of the operator, and an eviction frees
// spillway memory re-entrantly. None of that happens when spillway's simulated device is detached
// from torch (spillway.install(backend="sim")): CPU tensors come from torch's own allocator. With
// serve_cpu_tensors they come from the simulated device, whose memory is real host memory.
//
// Contract
// - serve_cpu_tensors(allocator): from then on every CPU tensor torch allocates is memory of
//   `allocator`'s device 0, on its default stream, under that device's budget: its statistics,
//   pressure handlers and out-of-memory error (c10::OutOfMemoryError, torch.OutOfMemoryError in
//   Python, after the whole pressure path) are those of that device. Tensors allocated before keep
//   their memory and their deleter.
// - `allocator` must be on the simulated device (backend "sim"); it is kept alive, and torch's CPU
//   allocator stays spillway's, until the process ends (tensors may outlive everything else).
//   Once per process.
// - Host memory is not device memory: what spillway allocates as host memory (an activation's
//   spilled copy) takes torch's default CPU allocator, as pinned memory does on a GPU
//   (activation_manager.cpp, host_bytes).
// - A backend other than "sim", or a second call, throws spillway::invalid_argument naming it.
#pragma once

#include <memory>

#include "torch_allocator.hpp"

namespace spillway::torch_plugin {

void serve_cpu_tensors(std::shared_ptr<torch_allocator> allocator);

}  // namespace spillway::torch_plugin
