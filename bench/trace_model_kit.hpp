// trace_model_kit: what the synthetic models share (internal to trace_models): a portable random
// generator, and a training loop's memory bookkeeping on top of trace_builder — a clock that
// advances like kernels writing their outputs, parameters, .grad tensors with PyTorch's
// AccumulateGrad behaviour, and the optimizers' state and temporaries.
#pragma once

#include <cstdint>
#include <vector>

#include "trace_builder.hpp"

namespace spillway::trace {

// splitmix64: tiny, fast, and the same numbers everywhere (std::*_distribution is not).
struct portable_rng {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::uint64_t below(std::uint64_t n) noexcept { return n ? next() % n : 0; }
};

class training_kit {
 public:
  explicit training_kit(trace_builder& builder) : b_(builder) {}

  // An output of `bytes` written by a kernel on `stream`: the clock moves by the kernel's time
  // (2 us launch + bytes at ~2 TB/s), then the allocation is recorded.
  std::uint32_t alloc(std::uint64_t bytes, std::uint32_t stream = 0) {
    b_.advance(2000 + bytes / 2000);
    return b_.alloc(bytes, stream);
  }
  void free(std::uint32_t id) { b_.free(id); }
  void record_stream(std::uint32_t id, std::uint32_t stream) { b_.record_stream(id, stream); }

  // A parameter (fp32), allocated now and never freed. Returns its index.
  std::size_t add_param(std::uint64_t bytes) {
    params_.push_back({alloc(bytes), bytes, 0, false});
    return params_.size() - 1;
  }
  // The gradient of parameter `p` arrives: `temp_bytes` (the low-precision gradient of the
  // autocast copy, 0 when the op ran in fp32) is cast to fp32. AccumulateGrad steals the fp32
  // tensor when .grad is None, otherwise adds it in place and frees it.
  void accumulate_grad(std::size_t p, std::uint64_t temp_bytes) {
    param& pr = params_.at(p);
    const std::uint32_t temp = temp_bytes ? alloc(temp_bytes) : 0;
    const std::uint32_t g = alloc(pr.bytes);
    if (temp_bytes) free(temp);
    if (!pr.has_grad) {
      pr.grad = g;
      pr.has_grad = true;
    } else {
      free(g);
    }
  }
  // optimizer.zero_grad() with set_to_none=True (PyTorch's default): every .grad is freed.
  void zero_grad() {
    for (param& pr : params_) {
      if (pr.has_grad) free(pr.grad);
      pr.has_grad = false;
    }
  }
  // clip_grad_norm_ (foreach): one norm per gradient (small), their stack and the total norm.
  void clip_grad_norm() {
    std::vector<std::uint32_t> norms;
    for (const param& pr : params_) {
      if (pr.has_grad) norms.push_back(alloc(4));
    }
    if (norms.empty()) return;
    const std::uint32_t stacked = alloc(4 * norms.size());
    const std::uint32_t total = alloc(4);
    for (std::uint32_t n : norms) free(n);
    free(stacked);
    const std::uint32_t coef = alloc(4);
    free(coef);
    free(total);
  }
  // AdamW with foreach=True: exp_avg and exp_avg_sq on the first step (kept), then each step
  // allocates sqrt(exp_avg_sq) for every parameter and frees them at the end.
  void adamw_step() {
    if (state_.empty()) {
      for (const param& pr : params_) {
        state_.push_back(alloc(pr.bytes));
        state_.push_back(alloc(pr.bytes));
      }
    }
    std::vector<std::uint32_t> sqrt_temps;
    for (const param& pr : params_) sqrt_temps.push_back(alloc(pr.bytes));
    for (std::uint32_t t : sqrt_temps) free(t);
  }
  // SGD with momentum (foreach): momentum buffers on the first step; updates are in place.
  void sgd_step() {
    if (state_.empty()) {
      for (const param& pr : params_) state_.push_back(alloc(pr.bytes));
    }
    b_.advance(10000);
  }

 private:
  struct param {
    std::uint32_t id;
    std::uint64_t bytes;
    std::uint32_t grad;
    bool has_grad;
  };
  trace_builder& b_;
  std::vector<param> params_;
  std::vector<std::uint32_t> state_;
};

}  // namespace spillway::trace
