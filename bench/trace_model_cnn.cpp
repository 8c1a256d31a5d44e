// trace_model_cnn: the ResNet training step of trace_models.hpp.
//
// Basic blocks (two 3x3 convolutions, BatchNorm, ReLU in place, a 1x1 downsample where the shape
// changes), four stages of widths w, 2w, 4w, 8w, a 7x7 stem and max pool, average pool and a
// 1000-class head; activations in the autocast dtype, images fp32, SGD with momentum. Each
// convolution takes a cuDNN workspace around its kernel in forward and two in backward; the
// workspace size depends on the layer's shape (as cudnn.benchmark's choice does), not on chance.
// A tensor saved by several ops (a block's input) is reference counted and freed after its last
// backward use.
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "trace_model_kit.hpp"
#include "trace_models.hpp"

namespace spillway::trace {
namespace {

struct conv_layer { std::size_t w; std::uint64_t cin, cout, k, stride; };
struct bn_layer { std::size_t w, b; std::uint64_t c; };
struct block { conv_layer c1, c2; bn_layer n1, n2; bool down; conv_layer cd; bn_layer nd; };

struct conv_saved { std::uint32_t input, w_cast; std::uint64_t in_side, out_side; };
struct bn_saved { std::uint32_t input, mean, invstd, out; std::uint64_t side; };
struct block_saved { conv_saved c1, c2, cd; bn_saved n1, n2, nd; };

class resnet {
 public:
  resnet(const synth_options& o, training_kit& kit)
      : kit_(kit), P_(static_cast<std::uint64_t>(o.dtype_bytes)), B_(static_cast<std::uint64_t>(o.batch)) {
    const std::uint64_t w = static_cast<std::uint64_t>(o.width);
    stem_ = make_conv(3, w, 7, 2);
    stem_bn_ = make_bn(w);
    std::uint64_t c = w;
    const int per_stage = std::max(1, o.layers / 4);
    for (int stage = 0; stage < 4; ++stage) {
      const std::uint64_t cout = w << stage;
      for (int i = 0; i < per_stage; ++i) {
        const std::uint64_t stride = (stage > 0 && i == 0) ? 2 : 1;
        block b{make_conv(c, cout, 3, stride), make_conv(cout, cout, 3, 1), make_bn(cout), make_bn(cout),
                stride != 1 || c != cout, {}, {}};
        if (b.down) {
          b.cd = make_conv(c, cout, 1, stride);
          b.nd = make_bn(cout);
        }
        blocks_.push_back(b);
        c = cout;
      }
    }
    channels_ = c;
    fc_w_ = kit_.add_param(1000 * c * 4);
    fc_b_ = kit_.add_param(1000 * 4);
  }

  // Forward and backward on images of side `side` (a multiple of 32); `prefetch` runs halfway
  // through the forward.
  template <class Prefetch>
  void step(std::uint64_t side, Prefetch&& prefetch) {
    // Stem: cast the fp32 images, 7x7/2 convolution, BatchNorm, ReLU, 3x3/2 max pool.
    const std::uint32_t img_cast = kit_.alloc(B_ * 3 * side * side * P_);
    std::uint32_t out = 0;
    const conv_saved cs = conv_forward(stem_, img_cast, side, out);
    const bn_saved ns = bn_forward(stem_bn_, out, side / 2);
    std::uint64_t s = side / 4;
    hold(ns.out);  // saved by ReLU (its output) and by the max pool (its input)
    const std::uint32_t pooled = kit_.alloc(act(stem_.cout, s));
    const std::uint32_t indices = kit_.alloc(B_ * stem_.cout * s * s * 8);

    // A block's input is held by its convolutions (conv1, downsample), its output by its final
    // ReLU (out += identity; relu_(out)) until their backward steps.
    std::uint32_t x = pooled;
    std::vector<block_saved> saved;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      saved.push_back(block_forward(blocks_[i], x, s));
      s = saved.back().n2.side;
      x = saved.back().n2.out;
      hold(x);
      if (i == blocks_.size() / 2) prefetch();
    }

    // Head: average pool, fully connected, cross entropy in fp32.
    const std::uint32_t avg = kit_.alloc(act(channels_, 1));
    const std::uint32_t w_fc = kit_.alloc(1000 * channels_ * P_);
    const std::uint32_t logits = kit_.alloc(B_ * 1000 * P_);
    const std::uint32_t logits32 = kit_.alloc(B_ * 1000 * 4);
    kit_.free(logits);
    const std::uint32_t logprobs = kit_.alloc(B_ * 1000 * 4);
    kit_.free(logits32);
    const std::uint32_t loss = kit_.alloc(4);

    const std::uint32_t g_logprobs = kit_.alloc(B_ * 1000 * 4);
    kit_.free(logprobs);
    const std::uint32_t g_logits32 = kit_.alloc(B_ * 1000 * 4);
    kit_.free(g_logprobs);
    const std::uint32_t g_logits = kit_.alloc(B_ * 1000 * P_);
    kit_.free(g_logits32);
    const std::uint32_t g_avg = kit_.alloc(act(channels_, 1));
    kit_.accumulate_grad(fc_w_, 1000 * channels_ * P_);
    kit_.accumulate_grad(fc_b_, 0);
    kit_.free(w_fc);
    kit_.free(avg);
    kit_.free(g_logits);
    std::uint32_t g = kit_.alloc(act(channels_, s));
    kit_.free(g_avg);

    for (std::size_t i = blocks_.size(); i-- > 0;) g = block_backward(blocks_[i], saved[i], g);

    // Stem backward: max pool, ReLU, BatchNorm, convolution (the images need no gradient).
    const std::uint32_t g_pool_in = kit_.alloc(act(stem_.cout, ns.side));
    kit_.free(indices);
    kit_.free(g);
    g = relu_bn_backward(stem_bn_, ns, g_pool_in);
    conv_backward(stem_, cs, g, false);
    kit_.free(loss);
  }

 private:
  conv_layer make_conv(std::uint64_t cin, std::uint64_t cout, std::uint64_t k, std::uint64_t stride) {
    return {kit_.add_param(cout * cin * k * k * 4), cin, cout, k, stride};
  }
  bn_layer make_bn(std::uint64_t c) {
    bn_layer n{kit_.add_param(c * 4), kit_.add_param(c * 4), c};
    for (int i = 0; i < 3; ++i) kit_.alloc(i < 2 ? c * 4 : 8);  // running mean, var, batch count
    return n;
  }
  std::uint64_t act(std::uint64_t c, std::uint64_t side) const { return B_ * c * side * side * P_; }

  // A workspace size that depends only on the layer's shape: 0, 1/2, 1 or 2 times the output.
  static std::uint64_t workspace(const conv_layer& c, std::uint64_t out_bytes, int pass) {
    const std::uint64_t h = (c.cin * 31 + c.cout * 17 + c.k * 7 + c.stride * 3 + static_cast<std::uint64_t>(pass)) % 4;
    const std::uint64_t ws = h == 0 ? 0 : (out_bytes << (h - 1)) / 2;
    return std::min<std::uint64_t>(ws, std::uint64_t{256} << 20);
  }
  void scratch(std::uint64_t bytes) {
    if (bytes != 0) kit_.free(kit_.alloc(bytes));
  }

  void hold(std::uint32_t id) { ++refs_[id]; }
  void drop(std::uint32_t id) {
    if (--refs_[id] == 0) {
      refs_.erase(id);
      kit_.free(id);
    }
  }

  conv_saved conv_forward(const conv_layer& c, std::uint32_t input, std::uint64_t in_side, std::uint32_t& out) {
    hold(input);
    const std::uint64_t out_side = in_side / c.stride;
    conv_saved s{input, kit_.alloc(c.cout * c.cin * c.k * c.k * P_), in_side, out_side};
    scratch(workspace(c, act(c.cout, out_side), 0));
    out = kit_.alloc(act(c.cout, out_side));
    return s;
  }
  bn_saved bn_forward(const bn_layer& n, std::uint32_t input, std::uint64_t side) {
    return {input, kit_.alloc(n.c * 4), kit_.alloc(n.c * 4), kit_.alloc(act(n.c, side)), side};
  }

  block_saved block_forward(const block& b, std::uint32_t x, std::uint64_t side) {
    block_saved s{};
    std::uint32_t out = 0;
    s.c1 = conv_forward(b.c1, x, side, out);
    s.n1 = bn_forward(b.n1, out, s.c1.out_side);
    hold(s.n1.out);  // ReLU (in place) saved its output; conv2 holds it too
    s.c2 = conv_forward(b.c2, s.n1.out, s.c1.out_side, out);
    s.n2 = bn_forward(b.n2, out, s.c2.out_side);
    if (b.down) {
      s.cd = conv_forward(b.cd, x, side, out);
      s.nd = bn_forward(b.nd, out, s.cd.out_side);
      kit_.free(s.nd.out);  // added into n2's output in place, then no longer needed
    }
    return s;
  }

  // ReLU backward (it saved its output, `s.out`), then BatchNorm backward. Frees `g` and what
  // they saved; returns the gradient of the BatchNorm input.
  std::uint32_t relu_bn_backward(const bn_layer& n, const bn_saved& s, std::uint32_t g) {
    const std::uint32_t g_relu = kit_.alloc(act(n.c, s.side));
    kit_.free(g);
    drop(s.out);
    const std::uint32_t g_in = bn_backward(n, s);
    kit_.free(g_relu);
    return g_in;
  }
  // Frees what the forward saved; the caller frees the incoming gradient (a block's sum gradient
  // feeds two BatchNorms).
  std::uint32_t bn_backward(const bn_layer& n, const bn_saved& s) {
    const std::uint32_t g_in = kit_.alloc(act(n.c, s.side));
    kit_.accumulate_grad(n.w, 0);
    kit_.accumulate_grad(n.b, 0);
    kit_.free(s.input);
    kit_.free(s.mean);
    kit_.free(s.invstd);
    return g_in;
  }
  // Data gradient (when the input needs one) and weight gradient, each with its workspace.
  // Frees `g` and what the forward saved; returns the input gradient or 0.
  std::uint32_t conv_backward(const conv_layer& c, const conv_saved& s, std::uint32_t g, bool input_grad) {
    const std::uint64_t out_bytes = act(c.cout, s.out_side);
    std::uint32_t g_in = 0;
    if (input_grad) {
      scratch(workspace(c, out_bytes, 1));
      g_in = kit_.alloc(act(c.cin, s.in_side));
    }
    scratch(workspace(c, out_bytes, 2));
    kit_.accumulate_grad(c.w, c.cout * c.cin * c.k * c.k * P_);
    kit_.free(s.w_cast);
    drop(s.input);
    kit_.free(g);
    return g_in;
  }

  std::uint32_t block_backward(const block& b, const block_saved& s, std::uint32_t g) {
    // Final ReLU (saved the block output), then the sum splits the gradient into both branches.
    const std::uint32_t g_sum = kit_.alloc(act(b.n2.c, s.n2.side));
    kit_.free(g);
    drop(s.n2.out);
    std::uint32_t g_main = bn_backward(b.n2, s.n2);
    g_main = conv_backward(b.c2, s.c2, g_main, true);
    g_main = relu_bn_backward(b.n1, s.n1, g_main);
    g_main = conv_backward(b.c1, s.c1, g_main, true);
    std::uint32_t g_in = 0;
    if (b.down) {
      std::uint32_t g_short = bn_backward(b.nd, s.nd);
      g_short = conv_backward(b.cd, s.cd, g_short, true);
      g_in = kit_.alloc(act(b.c1.cin, s.c1.in_side));
      kit_.free(g_short);
    } else {
      g_in = kit_.alloc(act(b.c1.cin, s.c1.in_side));
    }
    kit_.free(g_main);
    kit_.free(g_sum);
    return g_in;
  }

  training_kit& kit_;
  std::uint64_t P_, B_;
  conv_layer stem_{};
  bn_layer stem_bn_{};
  std::vector<block> blocks_;
  std::uint64_t channels_ = 0;
  std::size_t fc_w_ = 0, fc_b_ = 0;
  std::unordered_map<std::uint32_t, int> refs_;
};

}  // namespace

void synthesize_cnn(const synth_options& o, double jitter, trace_builder& builder) {
  portable_rng rng{o.seed};
  training_kit kit(builder);
  resnet model(o, kit);
  const std::uint64_t B = static_cast<std::uint64_t>(o.batch);

  auto next_side = [&] {
    const double f = 1.0 - jitter * rng.uniform();
    const auto s = static_cast<std::uint64_t>(f * o.image) / 32 * 32;
    return std::max<std::uint64_t>(s, 32);
  };
  struct batch { std::uint64_t side; std::uint32_t images, labels; };
  auto load = [&](std::uint64_t side) {
    batch b{side, kit.alloc(B * 3 * side * side * 4, 1), kit.alloc(B * 8, 1)};
    kit.record_stream(b.images, 0);
    kit.record_stream(b.labels, 0);
    return b;
  };

  batch current = load(next_side());
  for (int it = 0; it < o.iterations; ++it) {
    batch next{};
    const bool more = it + 1 < o.iterations;
    model.step(current.side, [&] {
      if (more) next = load(next_side());
    });
    kit.free(current.images);
    kit.free(current.labels);
    kit.sgd_step();
    kit.zero_grad();
    current = next;
  }
}

}  // namespace spillway::trace
