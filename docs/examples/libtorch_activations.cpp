// spillway's activations in a LibTorch C++ program: saved tensors spill or are recomputed under
// pressure, with no Python. ctest builds and runs it (example_libtorch_activations) on CPU tensors.
#include <ATen/ATen.h>

#include <cstdio>
#include <vector>

#include "libtorch_activations.hpp"

using namespace spillway::torch_plugin;

int main() {
  enable_libtorch_hooks();                       // once, before the first backward

  std::vector<at::Tensor> weights;
  for (int i = 0; i < 8; ++i) weights.push_back((at::randn({512, 512}) * 0.05).requires_grad_());
  auto block = [&](int first) {
    return [&, first](const std::vector<at::Tensor>& in) {
      at::Tensor h = in[0];
      for (int i = first; i < first + 2; ++i) h = at::relu(at::matmul(h, weights[i]));
      return h;
    };
  };

  activation_options options;
  options.max_resident = std::size_t{1} << 20;   // keep at most 1 MiB of saved activations
  auto manager = activation_manager::make(options);

  at::Tensor loss;
  {
    activation_scope scope(manager);             // this thread's saved tensors go to the manager
    at::Tensor h = at::randn({256, 512});
    for (int first = 0; first < 8; first += 2) h = checkpoint(block(first), {h});
    loss = h.square().mean();
  }
  loss.backward();                               // evicted activations come back on use

  const activation_stats s = manager->stats();
  std::printf("packed %llu, spills %llu, drops %llu, recomputes %llu\n",
              static_cast<unsigned long long>(s.packed), static_cast<unsigned long long>(s.spills),
              static_cast<unsigned long long>(s.drops), static_cast<unsigned long long>(s.recomputes));
  return s.evictions > 0 && weights[0].grad().defined() ? 0 : 1;
}
