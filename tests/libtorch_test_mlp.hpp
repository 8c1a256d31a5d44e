// libtorch_test_mlp: the small model the LibTorch activation tests train: six linear layers in
// three checkpoint segments (libtorch_activations.hpp's checkpoint), with dropout (a replay must
// reproduce the RNG) and BatchNorm-like state updated in place by layer 2 (a replay must not
// update it twice: it is listed in checkpoint's `keep`).
//
// Include after ATen and libtorch_activations.hpp; the caller chooses width, activation, dropout.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "libtorch_activations.hpp"

namespace spillway::test {

// The model's knobs.
struct libtorch_test_mlp_shape {
  int width = 128;
  double init_scale = 0.1;  // weights ~ N(0, init_scale^2)
  double dropout = 0.2;
  std::function<at::Tensor(const at::Tensor&)> activation = [](const at::Tensor& t) {
    return at::relu(t);
  };
};

struct libtorch_test_mlp {
  using shape = libtorch_test_mlp_shape;

  shape s;
  std::vector<at::Tensor> weights, biases;
  at::Tensor running;  // updated in place by the forward

  explicit libtorch_test_mlp(shape sh = {}) : s(std::move(sh)) {
    at::manual_seed(0);
    for (int i = 0; i < 6; ++i) {
      weights.push_back((at::randn({s.width, s.width}) * s.init_scale).requires_grad_());
      biases.push_back(at::zeros({s.width}).requires_grad_());
    }
    running = at::zeros({s.width});
  }
  at::Tensor layer(int i, const at::Tensor& x) const {
    at::Tensor h = s.activation(at::linear(x, weights[i], biases[i]));
    if (i == 2) {
      at::NoGradGuard no_grad;
      running.mul_(0.9).add_(h.detach().mean(0), 0.1);
    }
    return at::dropout(h, s.dropout, /*train=*/true);
  }
  // With `segments`, each pair of layers is a checkpoint segment; without, a plain forward.
  at::Tensor forward(const at::Tensor& x, bool segments = true) const {
    at::Tensor h = x;
    for (int seg = 0; seg < 3; ++seg) {
      auto block = [this, seg](const std::vector<at::Tensor>& in) {
        return layer(2 * seg + 1, layer(2 * seg, in[0]));
      };
      h = segments ? torch_plugin::checkpoint(block, {h}, {running}) : block({h});
    }
    return h;
  }
  std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> g;
    for (const auto& w : weights) g.push_back(w.grad().clone());
    for (const auto& b : biases) g.push_back(b.grad().clone());
    return g;
  }
};

}  // namespace spillway::test
