// op_trace_builder: forward graph in, training-step trace out. The rules are in op_trace_builder.hpp.
#include "op_trace_builder.hpp"

#include <algorithm>

#include "spillway/errors.hpp"

namespace spillway::op_trace {

step_builder::value step_builder::new_buffer(std::uint64_t bytes, bool param) {
  if (bytes == 0) throw spillway::invalid_argument("step_builder: a buffer of 0 bytes");
  const auto v = static_cast<value>(trace_.buffers.size());
  trace_.buffers.push_back({v, bytes, param, never});
  needs_grad_.push_back(false);
  grad_.push_back(no_grad);
  return v;
}

step_builder::value step_builder::weight(std::uint64_t bytes) {
  const value w = new_buffer(bytes, true);
  needs_grad_[w] = true;
  new_buffer(bytes, true);  // its gradient, accumulated in place
  return w;
}

step_builder::value step_builder::input(std::uint64_t bytes) { return new_buffer(bytes, true); }

std::uint64_t step_builder::elementwise_ns(std::uint64_t bytes_moved) const {
  return std::max(min_op_ns_, static_cast<std::uint64_t>(static_cast<double>(bytes_moved) / bandwidth_));
}

std::vector<step_builder::value> step_builder::op(const std::string& name, std::uint64_t duration_ns,
                                                  const std::vector<value>& inputs,
                                                  const std::vector<std::uint64_t>& out_bytes, saved what,
                                                  std::uint64_t backward_ns) {
  bool grad = false;
  for (value in : inputs) {
    if (in >= trace_.buffers.size()) throw spillway::invalid_argument("step_builder: op " + name + " reads an unknown buffer");
    grad = grad || needs_grad_[in];
  }
  op_trace::op o;
  o.name = name;
  o.duration_ns = duration_ns;
  o.inputs = inputs;
  std::sort(o.inputs.begin(), o.inputs.end());
  o.inputs.erase(std::unique(o.inputs.begin(), o.inputs.end()), o.inputs.end());
  for (std::uint64_t b : out_bytes) {
    const value v = new_buffer(b, false);
    needs_grad_[v] = grad;
    o.outputs.push_back(v);
  }
  std::vector<value> outs = o.outputs;
  forward_.push_back({trace_.ops.size(), what, backward_ns});
  trace_.ops.push_back(std::move(o));
  return outs;
}

void step_builder::add_gradient(value of, value partial, const std::string& name) {
  if (grad_[of] == no_grad) {
    grad_[of] = partial;
    return;
  }
  const std::uint64_t b = bytes(of);
  const value sum = new_buffer(b, false);
  trace_.ops.push_back({name + ".acc", elementwise_ns(3 * b), {grad_[of], partial}, {sum}});
  std::sort(trace_.ops.back().inputs.begin(), trace_.ops.back().inputs.end());
  grad_[of] = sum;
}

trace_data step_builder::finish(value loss, const std::string& model, const std::string& source) {
  if (loss >= trace_.buffers.size() || trace_.buffers[loss].param) {
    throw spillway::invalid_argument("step_builder: the loss must be an op's output");
  }
  trace_.model = model;
  trace_.source = source;
  trace_.phases.push_back({trace_.ops.size(), "backward"});
  const value seed = new_buffer(bytes(loss), false);
  trace_.ops.push_back({"grad_seed", min_op_ns_, {}, {seed}});
  grad_[loss] = seed;

  for (auto f = forward_.rbegin(); f != forward_.rend(); ++f) {
    const op_trace::op fwd = trace_.ops[f->op_index];  // a copy: ops grows below
    op_trace::op bwd;
    bwd.name = fwd.name + ".bwd";
    bwd.duration_ns = f->backward_ns;
    for (value out : fwd.outputs) {
      if (grad_[out] != no_grad) bwd.inputs.push_back(grad_[out]);
    }
    if (bwd.inputs.empty()) continue;  // nothing downstream reached the loss
    if (f->what == saved::inputs || f->what == saved::both) {
      bwd.inputs.insert(bwd.inputs.end(), fwd.inputs.begin(), fwd.inputs.end());
      if (!fwd.outputs.empty()) bwd.inputs.insert(bwd.inputs.end(), fwd.outputs.begin() + 1, fwd.outputs.end());
    }
    if (f->what == saved::outputs || f->what == saved::both) {
      bwd.inputs.insert(bwd.inputs.end(), fwd.outputs.begin(), fwd.outputs.end());
    }
    std::sort(bwd.inputs.begin(), bwd.inputs.end());
    bwd.inputs.erase(std::unique(bwd.inputs.begin(), bwd.inputs.end()), bwd.inputs.end());
    std::vector<std::pair<value, value>> partials;  // (input, its partial gradient)
    for (value in : fwd.inputs) {
      if (trace_.buffers[in].param || !needs_grad_[in]) continue;  // weights accumulate in place
      const value g = new_buffer(bytes(in), false);
      bwd.outputs.push_back(g);
      partials.emplace_back(in, g);
    }
    trace_.ops.push_back(std::move(bwd));
    for (const auto& [in, g] : partials) add_gradient(in, g, fwd.name);
  }
  trace_data out = std::move(trace_);
  trace_ = {};
  forward_.clear();
  return out;
}

}  // namespace spillway::op_trace
