// trace_models: synthetic alloc/free traces shaped like training jobs, for replay when no recorded
// PyTorch trace is at hand (and for smoke tests). The tool is spillway-trace-synth (trace_synth.cpp).
//
// Models (each event mimics what PyTorch's autograd and optimizers allocate under autocast):
// - transformer: a GPT-style decoder. Parameters, then per iteration: a batch copied in on stream 1
//   (record_stream onto stream 0, the next batch prefetched mid-forward), a forward pass that saves
//   activations per layer (LayerNorm statistics and biases are small-pool sizes, activations and
//   weight casts large), a backward pass in reverse that frees them while allocating gradients,
//   gradient clipping and an AdamW (foreach) step, zero_grad(set_to_none). The sequence length of
//   each batch varies by `jitter` (dynamic padding), which is what makes real traces fragment.
// - cnn: a ResNet of basic blocks (layers = blocks, 4 stages), cuDNN workspaces around every
//   convolution, BatchNorm statistics, SGD with momentum. `jitter` varies the image side
//   (multi-scale training; default 0).
// - random: allocations of log-uniform sizes on a few streams with random lifetimes, the live
//   bytes held near `live_bytes`, some record_stream across streams. A stress shape, not a model.
//
// Contract: the same options (and seed) give the same trace, byte for byte, on every platform
// (the generator uses its own splitmix64, not <random>'s distributions). Options out of range
// throw spillway::invalid_argument naming the option and the value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "trace_format.hpp"

namespace spillway::trace {

struct synth_options {
  std::string model = "transformer";  // transformer | cnn | random
  std::uint64_t seed = 1;
  int iterations = 4;
  int layers = 0;        // transformer blocks / ResNet basic blocks; 0: the model's default (12 / 8)
  int batch = 0;         // 0: the model's default (8 / 32)
  int dtype_bytes = 2;   // activation element size (bf16/fp16 autocast); parameters are fp32
  std::optional<double> jitter;  // 0..0.9: shape variation per iteration; default 0.25 / 0
  // transformer
  int seq = 512, hidden = 1024, heads = 16, vocab = 32000;
  bool math_attention = false;  // materialise the S x S attention matrix instead of flash attention
  // cnn
  int image = 224, width = 64;
  // random
  std::uint64_t events = 20000;
  int streams = 2;
  std::size_t live_bytes = std::size_t{2} << 30;
  // header
  std::size_t device_capacity = std::size_t{80} << 30;  // what replay's simulated device gets
};

trace_data synthesize(const synth_options& options);

// The header's source field for these options, e.g. "synth:transformer:L12:B8:S512:H1024:seed1".
std::string describe(const synth_options& options);

}  // namespace spillway::trace
