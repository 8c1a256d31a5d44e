// op_trace_builder: writes the operator trace of a training step from its forward graph; the
// backward is derived the way autograd derives it. The synthetic models (op_trace_synth.hpp) use it.
//
// - weight(bytes) declares a parameter that needs a gradient, and a second parameter of the same
//   size for that gradient: gradients are accumulated in place into preallocated buffers (as with
//   zero_grad(set_to_none=False)), so they are memory, never outputs. input(bytes) declares a
//   parameter without a gradient (data, labels, token ids).
// - op(...) appends a forward op. Its `saved` says what its backward reads besides the gradients of
//   its outputs: its inputs (a linear layer: x and W), its outputs (ReLU, softmax), both or neither
//   (an addition). Saved buffers live until that backward runs, as autograd's saved tensors do.
//   Outputs after the first are auxiliary (batch-norm statistics, pooling indices): `inputs`
//   saves them too.
// - finish(loss) appends `phase backward`, a `grad_seed` op writing the loss's gradient, and for
//   each forward op in reverse whose outputs received a gradient, `<name>.bwd`: it reads the
//   output gradients and the saved buffers, and writes one gradient for each input that needs one
//   (an op output that depends on a weight). A buffer used by several ops receives one partial
//   gradient per use, summed by an `<op>.acc` op right after the backward of `<op>` that produced
//   the second (third, ...) partial, as autograd's accumulation does.
// - Costs are the caller's (op_trace_synth.hpp has the device model).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "op_trace.hpp"

namespace spillway::op_trace {

enum class saved { nothing, inputs, outputs, both };

class step_builder {
 public:
  using value = std::uint32_t;  // a buffer index

  // elementwise_bytes_per_ns: the speed of the accumulation ops' cost (bytes read + written / ns).
  explicit step_builder(double elementwise_bytes_per_ns = 2000, std::uint64_t min_op_ns = 2000)
      : bandwidth_(elementwise_bytes_per_ns), min_op_ns_(min_op_ns) {}

  value weight(std::uint64_t bytes);
  value input(std::uint64_t bytes);

  // A forward op writing one buffer per entry of out_bytes; returns them in that order.
  std::vector<value> op(const std::string& name, std::uint64_t duration_ns, const std::vector<value>& inputs,
                        const std::vector<std::uint64_t>& out_bytes, saved what, std::uint64_t backward_ns);
  value op1(const std::string& name, std::uint64_t duration_ns, const std::vector<value>& inputs,
            std::uint64_t out_bytes, saved what, std::uint64_t backward_ns) {
    return op(name, duration_ns, inputs, {out_bytes}, what, backward_ns).front();
  }

  std::uint64_t bytes(value v) const { return trace_.buffers.at(v).bytes; }
  std::uint64_t elementwise_ns(std::uint64_t bytes_moved) const;

  // Appends the backward from `loss` and returns the trace. The builder is spent afterwards.
  trace_data finish(value loss, const std::string& model, const std::string& source);

 private:
  struct forward_op {
    std::size_t op_index;
    saved what;
    std::uint64_t backward_ns;
  };
  value new_buffer(std::uint64_t bytes, bool param);
  void add_gradient(value of, value partial, const std::string& name);

  double bandwidth_;
  std::uint64_t min_op_ns_;
  trace_data trace_;
  std::vector<bool> needs_grad_;   // per buffer
  std::vector<value> grad_;        // per buffer; no_grad when none yet
  std::vector<forward_op> forward_;
  static constexpr value no_grad = static_cast<value>(-1);
};

}  // namespace spillway::op_trace
