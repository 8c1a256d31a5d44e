// process_instance: the one plugin_allocator of a process that loaded libspillway_alloc.so or
// libspillway_preload.so, and the per-thread state of their C entry points.
//
// - process_allocator() builds the plugin_allocator on first use from SPILLWAY_CONF (read here,
//   at the edge, once) and returns it ever after. When SPILLWAY_CONF is invalid or the backend
//   cannot be made, it throws that error, the same one every time: the first failure is final.
//   The instance is never destroyed: at exit the CUDA runtime may already be unloading, and the
//   driver returns the memory of a process that ends anyway (PyTorch does the same).
// - last_error(): the message of the most recent failure of a spillway entry point on this thread
//   ("" if none). Successful calls leave it alone, like errno.
// - report(message): a problem that cannot be returned: stored as the last error and written to
//   stderr. It is also the warning sink of the allocators (allocator_config::on_warning).
// - entry_scope: opened by every C entry point for the duration of its call into spillway. The
//   preload shim's CUDA interposers send calls made while one is open on this thread straight to
//   the real CUDA runtime (Note [Preload re-entrancy] in docs/integration.md).
#pragma once

#include <string>

#include "plugin_allocator.hpp"

namespace spillway::plugin {

plugin_allocator& process_allocator();
// Whether process_allocator() has been built with backend "cuda" (so it holds CUDA state, which a
// forked child cannot use). Never throws, builds nothing.
bool holds_cuda_state() noexcept;

const std::string& last_error() noexcept;
void set_last_error(std::string message) noexcept;
void report(const std::string& message) noexcept;

class entry_scope {
 public:
  entry_scope() noexcept;
  ~entry_scope();
  entry_scope(const entry_scope&) = delete;
  entry_scope& operator=(const entry_scope&) = delete;

  static bool active() noexcept;  // a scope is open on this thread
};

}  // namespace spillway::plugin
