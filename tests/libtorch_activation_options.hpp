// libtorch_activation_options: the activation_manager options the LibTorch activation tests
// share (test_libtorch_activations.cpp, test_libtorch_restores.cpp).
#pragma once

#include "activation_manager.hpp"

namespace spillway::test {

// Drop-only, every size, evicting only when the test calls evict().
inline torch_plugin::activation_options drop_when_asked(
    torch_plugin::activation_policy policy = torch_plugin::activation_policy::dtr) {
  torch_plugin::activation_options o;
  o.mode = torch_plugin::activation_mode::drop;
  o.policy = policy;
  o.min_bytes = 0;
  return o;
}

// Every size, evicted whenever it can be (max_resident 0), in `mode`.
inline torch_plugin::activation_options evict_all(torch_plugin::activation_mode mode) {
  torch_plugin::activation_options o;
  o.max_resident = 0;
  o.mode = mode;
  o.min_bytes = 0;
  return o;
}

}  // namespace spillway::test
