// process_instance.cpp: the process-wide plugin_allocator and per-thread entry state. The contract
// is in process_instance.hpp.
#include "process_instance.hpp"

#include <atomic>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "plugin_backends.hpp"
#include "spillway/errors.hpp"

namespace spillway::plugin {
namespace {

thread_local int entry_depth = 0;

std::string& last_error_slot() noexcept {
  thread_local std::string slot;
  return slot;
}

struct instance {
  std::unique_ptr<plugin_allocator> allocator;
  std::string error;       // why there is no allocator
  bool bad_input = false;  // the error is an invalid_argument (SPILLWAY_CONF), not a device_error
};

std::atomic<bool> cuda_instance_built{false};

instance* build_instance() {
  auto* inst = new instance;  // never deleted: see process_instance.hpp
  const char* text = std::getenv("SPILLWAY_CONF");
  try {
    inst->allocator = make_plugin_allocator(parse_config(text != nullptr ? text : ""),
                                            {.on_warning = &report});
    cuda_instance_built.store(inst->allocator->config().backend == "cuda");
  } catch (const invalid_argument& e) {
    inst->error = e.what();
    inst->bad_input = true;
  } catch (const std::exception& e) {
    inst->error = e.what();
  }
  return inst;
}

}  // namespace

bool holds_cuda_state() noexcept { return cuda_instance_built.load(); }

plugin_allocator& process_allocator() {
  static instance* const inst = build_instance();  // thread-safe, once
  if (inst->allocator) return *inst->allocator;
  if (inst->bad_input) throw invalid_argument(inst->error);
  throw device_error(inst->error);
}

const std::string& last_error() noexcept { return last_error_slot(); }

void set_last_error(std::string message) noexcept { last_error_slot() = std::move(message); }

void report(const std::string& message) noexcept {
  try {
    set_last_error(message);
    std::fprintf(stderr, "%s\n", message.c_str());
  } catch (...) {
    // Reporting must never turn into a failure of the call that reports.
  }
}

entry_scope::entry_scope() noexcept { ++entry_depth; }
entry_scope::~entry_scope() { --entry_depth; }
bool entry_scope::active() noexcept { return entry_depth > 0; }

}  // namespace spillway::plugin
