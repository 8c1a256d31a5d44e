// test_libtorch_hooks_engine: enable_libtorch_hooks (libtorch_activations.hpp) installs spillway's
// autograd engine only over LibTorch's base engine. Another engine (a Python process's, or one a
// program set) is refused with a clear error and kept as it was; the call then succeeds once the
// base engine is back. A binary of its own: the default engine is process-wide.
#include "torch_doctest.hpp"  // ATen and doctest
#include <torch/csrc/autograd/engine.h>

#include <stdexcept>
#include <string>
#include <typeinfo>

#include "libtorch_activations.hpp"

namespace {

struct other_engine : torch::autograd::Engine {};

torch::autograd::Engine& other_engine_instance() {
  static auto* engine = new other_engine;  // never destroyed, like the base engine
  return *engine;
}

}  // namespace

TEST_CASE("another default engine is refused and kept; over the base engine the hooks install") {
  torch::autograd::set_default_engine_stub(&other_engine_instance);
  try {
    spillway::torch_plugin::enable_libtorch_hooks();
    FAIL("no exception");
  } catch (const std::logic_error& e) {
    CHECK(std::string(e.what()).find("the default autograd engine is not LibTorch's base engine") !=
          std::string::npos);
  }
  CHECK(&torch::autograd::Engine::get_default_engine() == &other_engine_instance());

  torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);
  spillway::torch_plugin::enable_libtorch_hooks();
  auto& engine = torch::autograd::Engine::get_default_engine();
  CHECK(typeid(engine) != typeid(torch::autograd::Engine));
  CHECK(typeid(engine) != typeid(other_engine));
  spillway::torch_plugin::enable_libtorch_hooks();  // once is enough; again changes nothing
  CHECK(&torch::autograd::Engine::get_default_engine() == &engine);
}
