// lineage: the recipe that recomputes dropped buffers.
//
// A lineage node is an operation: a callable that writes its outputs from its inputs, in stream
// order on the stream it is given, plus its measured cost. Its outputs are the buffers registered
// with buffer_options::producer == the node; its inputs are buffers too (any state).
//
// Contract of compute
// - It is called with device pointers of every input (resident, pinned for the duration of the
//   call) and of every output (freshly allocated, or a scratch block for an output that is still
//   resident), in output_index order.
// - It must be deterministic: recomputation has to reproduce the bytes bit for bit. (Random state
//   is the caller's to capture, e.g. the RNG seed of a dropout.)
// - It may allocate temporaries from the same allocator; it must not call into the engine.
// - It runs with the engine's lock held; keep it to enqueuing work.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "spillway/device_backend.hpp"
#include "spillway/eviction/buffer.hpp"

namespace spillway::eviction {

using compute_fn = std::function<void(std::span<void* const> inputs,
                                      std::span<void* const> outputs, stream_ref stream)>;

struct lineage_node {
  std::string name;                // for messages ("conv3", "block7.mlp")
  std::vector<buffer_id> inputs;
  std::size_t output_count = 1;
  compute_fn compute;
  double cost_ns = 0;              // measured time of one compute call
};

}  // namespace spillway::eviction
