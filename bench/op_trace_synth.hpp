// op_trace_synth: synthetic operator traces of training steps, so the eviction simulator has
// traces without torch. Shapes:
//   mlp          a chain: fc_i = relu(W_i x_{i-1}) with heterogeneous widths; its backward reads
//                x_{i-1} and x_i. The chain that rotor's optimum is exact for.
//   transformer  a stack of pre-LN GPT blocks (attention with materialised scores, GELU MLP),
//                residual adds (diamonds), an attention mask shared by every block, an LM head.
//   resnet       ResNet-50-shaped bottleneck blocks (conv-bn-relu x3, projection shortcuts),
//                skip connections as diamonds.
//   unet         a U-Net: long skips from each encoder level to its decoder level.
// Costs model one GPU: matrix and convolution work at `flops_per_ns`, elementwise work at
// `bytes_per_ns`, and no op shorter than `min_op_ns`. Backward ops cost twice their forward.
// Everything is deterministic given the options (the mlp's widths come from `seed`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "op_trace.hpp"

namespace spillway::op_trace {

struct synth_options {
  std::string model = "mlp";   // mlp, transformer, resnet, unet
  int layers = 0;              // 0: the model's default (mlp 32, transformer 6, resnet 16 blocks, unet 4 levels)
  int batch = 0;               // 0: the model's default
  int width = 0;               // mlp: mean width; transformer: hidden size; 0: default
  bool shared_weights = false; // mlp: one weight for every layer (an unrolled RNN): activations dominate
  std::uint64_t seed = 1;
  double flops_per_ns = 1e5;   // 100 TFLOP/s
  double bytes_per_ns = 2000;  // 2 TB/s
  std::uint64_t min_op_ns = 3000;
};

std::vector<std::string> synth_models();
trace_data synthesize(const synth_options& options);  // invalid_argument for an unknown model

// "mlp", "mlp:layers=64,batch=4096", "transformer:layers=4": the spec form the tools accept.
synth_options parse_synth_spec(const std::string& spec);
std::string describe(const synth_options& options);  // the spec that gives this trace back

}  // namespace spillway::op_trace
