// trace_model_transformer: the GPT-style training step of trace_models.hpp.
//
// Per token count T = batch x sequence length, hidden H, MLP width F = 4H, element size P of
// autocast outputs, the residual stream and LayerNorm run in fp32 (4 bytes) as under autocast.
// Every saved tensor is freed by the backward step of the op that saved it, in reverse order.
#include <vector>

#include "trace_model_kit.hpp"
#include "trace_models.hpp"

namespace spillway::trace {
namespace {

struct layer_params {
  std::size_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

// What one layer's forward keeps for its backward.
struct layer_saved {
  std::uint32_t x_in, ln1_out, ln1_mean, ln1_rstd, ln1_cast, w_qkv, qkv;
  std::vector<std::uint32_t> attention;  // flash: out, logsumexp; math: probs, dropout mask, dropped
  std::uint32_t ctx, w_proj, drop1_mask, x_mid, ln2_out, ln2_mean, ln2_rstd, ln2_cast, w_fc1, fc1_out,
      gelu_out, w_fc2, drop2_mask;
};

class transformer {
 public:
  transformer(const synth_options& o, training_kit& kit)
      : o_(o), kit_(kit), H_(static_cast<std::uint64_t>(o.hidden)), F_(4 * H_),
        P_(static_cast<std::uint64_t>(o.dtype_bytes)) {
    const std::uint64_t V = static_cast<std::uint64_t>(o.vocab);
    tok_emb_ = kit_.add_param(V * H_ * 4);
    pos_emb_ = kit_.add_param(static_cast<std::uint64_t>(o.seq) * H_ * 4);
    for (int l = 0; l < o.layers; ++l) {
      layer_params p;
      p.ln1_w = kit_.add_param(H_ * 4);
      p.ln1_b = kit_.add_param(H_ * 4);
      p.qkv_w = kit_.add_param(3 * H_ * H_ * 4);
      p.qkv_b = kit_.add_param(3 * H_ * 4);
      p.proj_w = kit_.add_param(H_ * H_ * 4);
      p.proj_b = kit_.add_param(H_ * 4);
      p.ln2_w = kit_.add_param(H_ * 4);
      p.ln2_b = kit_.add_param(H_ * 4);
      p.fc1_w = kit_.add_param(F_ * H_ * 4);
      p.fc1_b = kit_.add_param(F_ * 4);
      p.fc2_w = kit_.add_param(H_ * F_ * 4);
      p.fc2_b = kit_.add_param(H_ * 4);
      params_.push_back(p);
    }
    lnf_w_ = kit_.add_param(H_ * 4);
    lnf_b_ = kit_.add_param(H_ * 4);
  }

  // Forward and backward of one batch of `seq` tokens per sample. `prefetch` runs mid-forward
  // (the loader's copy of the next batch).
  template <class Prefetch>
  void step(std::uint64_t seq, Prefetch&& prefetch) {
    T_ = static_cast<std::uint64_t>(o_.batch) * seq;
    S_ = seq;
    const std::uint64_t V = static_cast<std::uint64_t>(o_.vocab);

    // Embedding: token + position lookups (fp32), summed into the residual stream.
    const std::uint32_t tok = kit_.alloc(T_ * H_ * 4);
    const std::uint32_t pos = kit_.alloc(S_ * H_ * 4);
    std::uint32_t x = kit_.alloc(T_ * H_ * 4);
    kit_.free(tok);
    kit_.free(pos);

    std::vector<layer_saved> saved;
    for (int l = 0; l < o_.layers; ++l) {
      saved.push_back(forward_layer(x));
      x = out_;  // the layer's output: the next layer's input
      if (l == o_.layers / 2) prefetch();
    }

    // Final LayerNorm, tied LM head, cross entropy in fp32.
    const std::uint32_t lnf_out = kit_.alloc(T_ * H_ * 4);
    const std::uint32_t lnf_mean = kit_.alloc(T_ * 4), lnf_rstd = kit_.alloc(T_ * 4);
    const std::uint32_t lnf_cast = kit_.alloc(T_ * H_ * P_);
    const std::uint32_t w_head = kit_.alloc(V * H_ * P_);
    const std::uint32_t logits = kit_.alloc(T_ * V * P_);
    const std::uint32_t logits32 = kit_.alloc(T_ * V * 4);
    kit_.free(logits);
    const std::uint32_t logprobs = kit_.alloc(T_ * V * 4);
    kit_.free(logits32);
    const std::uint32_t loss = kit_.alloc(4), total_weight = kit_.alloc(4);

    // Backward, from the loss down.
    const std::uint32_t g_loss = kit_.alloc(4);
    const std::uint32_t g_logprobs = kit_.alloc(T_ * V * 4);
    kit_.free(g_loss);
    kit_.free(total_weight);
    const std::uint32_t g_logits32 = kit_.alloc(T_ * V * 4);
    kit_.free(g_logprobs);
    kit_.free(logprobs);
    const std::uint32_t g_logits = kit_.alloc(T_ * V * P_);
    kit_.free(g_logits32);
    const std::uint32_t g_lnf_cast = kit_.alloc(T_ * H_ * P_);
    kit_.accumulate_grad(tok_emb_, V * H_ * P_);
    kit_.free(g_logits);
    kit_.free(w_head);
    kit_.free(lnf_cast);
    const std::uint32_t g_lnf = kit_.alloc(T_ * H_ * 4);
    kit_.free(g_lnf_cast);
    std::uint32_t g = kit_.alloc(T_ * H_ * 4);
    kit_.accumulate_grad(lnf_w_, 0);
    kit_.accumulate_grad(lnf_b_, 0);
    kit_.free(g_lnf);
    kit_.free(lnf_out);
    kit_.free(lnf_mean);
    kit_.free(lnf_rstd);
    kit_.free(x);  // the last layer's output, saved by the final LayerNorm

    for (int l = o_.layers - 1; l >= 0; --l) g = backward_layer(params_[l], saved[l], g);

    // Embedding backward: dense gradients of both tables.
    kit_.accumulate_grad(pos_emb_, 0);
    kit_.accumulate_grad(tok_emb_, 0);
    kit_.free(g);
    kit_.free(loss);
  }

 private:
  layer_saved forward_layer(std::uint32_t x) {
    const std::uint64_t B = static_cast<std::uint64_t>(o_.batch), h = static_cast<std::uint64_t>(o_.heads);
    layer_saved s;
    s.x_in = x;
    s.ln1_out = kit_.alloc(T_ * H_ * 4);
    s.ln1_mean = kit_.alloc(T_ * 4);
    s.ln1_rstd = kit_.alloc(T_ * 4);
    s.ln1_cast = kit_.alloc(T_ * H_ * P_);
    s.w_qkv = kit_.alloc(3 * H_ * H_ * P_);
    s.qkv = kit_.alloc(T_ * 3 * H_ * P_);
    std::uint32_t attn_out;
    if (o_.math_attention) {
      const std::uint32_t scores = kit_.alloc(B * h * S_ * S_ * P_);
      const std::uint32_t probs = kit_.alloc(B * h * S_ * S_ * P_);
      kit_.free(scores);
      const std::uint32_t mask = kit_.alloc(B * h * S_ * S_);
      const std::uint32_t dropped = kit_.alloc(B * h * S_ * S_ * P_);
      s.attention = {probs, mask, dropped};
      attn_out = kit_.alloc(T_ * H_ * P_);
    } else {
      attn_out = kit_.alloc(T_ * H_ * P_);
      s.attention = {attn_out, kit_.alloc(B * h * S_ * 4)};  // output and logsumexp
    }
    s.ctx = kit_.alloc(T_ * H_ * P_);  // heads transposed back, contiguous
    if (o_.math_attention) kit_.free(attn_out);
    s.w_proj = kit_.alloc(H_ * H_ * P_);
    const std::uint32_t proj = kit_.alloc(T_ * H_ * P_);
    s.drop1_mask = kit_.alloc(T_ * H_);
    const std::uint32_t drop1 = kit_.alloc(T_ * H_ * P_);
    kit_.free(proj);
    s.x_mid = kit_.alloc(T_ * H_ * 4);
    kit_.free(drop1);
    s.ln2_out = kit_.alloc(T_ * H_ * 4);
    s.ln2_mean = kit_.alloc(T_ * 4);
    s.ln2_rstd = kit_.alloc(T_ * 4);
    s.ln2_cast = kit_.alloc(T_ * H_ * P_);
    s.w_fc1 = kit_.alloc(F_ * H_ * P_);
    s.fc1_out = kit_.alloc(T_ * F_ * P_);
    s.gelu_out = kit_.alloc(T_ * F_ * P_);
    s.w_fc2 = kit_.alloc(H_ * F_ * P_);
    const std::uint32_t fc2 = kit_.alloc(T_ * H_ * P_);
    s.drop2_mask = kit_.alloc(T_ * H_);
    const std::uint32_t drop2 = kit_.alloc(T_ * H_ * P_);
    kit_.free(fc2);
    out_ = kit_.alloc(T_ * H_ * 4);
    kit_.free(drop2);
    return s;
  }

  // A linear layer's backward: input gradient, weight and bias gradients, then its saved tensors.
  std::uint32_t linear_backward(std::uint32_t g_out, std::uint64_t in_features, std::size_t w,
                                std::size_t b, std::uint64_t out_features, std::uint32_t w_cast,
                                std::uint32_t input_cast) {
    const std::uint32_t g_in = kit_.alloc(T_ * in_features * P_);
    kit_.accumulate_grad(w, in_features * out_features * P_);
    kit_.accumulate_grad(b, 0);
    kit_.free(w_cast);
    kit_.free(input_cast);
    kit_.free(g_out);
    return g_in;
  }

  std::uint32_t backward_layer(const layer_params& p, layer_saved& s, std::uint32_t g) {
    // MLP branch: dropout, fc2, gelu, fc1, LayerNorm 2.
    std::uint32_t g_b = kit_.alloc(T_ * H_ * P_);
    kit_.free(s.drop2_mask);
    g_b = linear_backward(g_b, F_, p.fc2_w, p.fc2_b, H_, s.w_fc2, s.gelu_out);
    const std::uint32_t g_fc1 = kit_.alloc(T_ * F_ * P_);
    kit_.free(g_b);
    kit_.free(s.fc1_out);
    g_b = linear_backward(g_fc1, H_, p.fc1_w, p.fc1_b, F_, s.w_fc1, s.ln2_cast);
    const std::uint32_t g_ln2 = kit_.alloc(T_ * H_ * 4);
    kit_.free(g_b);
    const std::uint32_t g_mlp = kit_.alloc(T_ * H_ * 4);
    kit_.accumulate_grad(p.ln2_w, 0);
    kit_.accumulate_grad(p.ln2_b, 0);
    kit_.free(g_ln2);
    kit_.free(s.ln2_out);
    kit_.free(s.ln2_mean);
    kit_.free(s.ln2_rstd);
    kit_.free(s.x_mid);
    const std::uint32_t g_mid = kit_.alloc(T_ * H_ * 4);  // residual: g + g_mlp
    kit_.free(g);
    kit_.free(g_mlp);

    // Attention branch: dropout, projection, attention, qkv, LayerNorm 1.
    g_b = kit_.alloc(T_ * H_ * P_);
    kit_.free(s.drop1_mask);
    g_b = linear_backward(g_b, H_, p.proj_w, p.proj_b, H_, s.w_proj, s.ctx);
    const std::uint32_t g_qkv = kit_.alloc(T_ * 3 * H_ * P_);
    if (!o_.math_attention) {
      const std::uint32_t dq_accum = kit_.alloc(T_ * H_ * 4);  // flash backward's fp32 scratch
      kit_.free(dq_accum);
    }
    for (std::uint32_t id : s.attention) kit_.free(id);
    kit_.free(g_b);
    kit_.free(s.qkv);
    g_b = linear_backward(g_qkv, H_, p.qkv_w, p.qkv_b, 3 * H_, s.w_qkv, s.ln1_cast);
    const std::uint32_t g_ln1 = kit_.alloc(T_ * H_ * 4);
    kit_.free(g_b);
    const std::uint32_t g_attn = kit_.alloc(T_ * H_ * 4);
    kit_.accumulate_grad(p.ln1_w, 0);
    kit_.accumulate_grad(p.ln1_b, 0);
    kit_.free(g_ln1);
    kit_.free(s.ln1_out);
    kit_.free(s.ln1_mean);
    kit_.free(s.ln1_rstd);
    kit_.free(s.x_in);
    const std::uint32_t g_in = kit_.alloc(T_ * H_ * 4);
    kit_.free(g_mid);
    kit_.free(g_attn);
    return g_in;
  }

  const synth_options& o_;
  training_kit& kit_;
  std::uint64_t H_, F_, P_, T_ = 0, S_ = 0;
  std::size_t tok_emb_, pos_emb_, lnf_w_, lnf_b_;
  std::vector<layer_params> params_;
  std::uint32_t out_ = 0;
};

}  // namespace

void synthesize_transformer(const synth_options& o, double jitter, trace_builder& builder) {
  portable_rng rng{o.seed};
  training_kit kit(builder);
  transformer model(o, kit);
  const std::uint64_t B = static_cast<std::uint64_t>(o.batch);

  // The loader copies (tokens, labels) in on stream 1; the compute stream uses them.
  auto next_seq = [&] {
    const double f = 1.0 - jitter * rng.uniform();
    const auto s = static_cast<std::uint64_t>(f * o.seq + 7) / 8 * 8;  // padded to a multiple of 8
    return s < 8 ? std::uint64_t{8} : s;
  };
  struct batch { std::uint64_t seq; std::uint32_t tokens, labels; };
  auto load = [&](std::uint64_t seq) {
    batch b{seq, kit.alloc(B * seq * 8, 1), kit.alloc(B * seq * 8, 1)};
    kit.record_stream(b.tokens, 0);
    kit.record_stream(b.labels, 0);
    return b;
  };

  batch current = load(next_seq());
  for (int it = 0; it < o.iterations; ++it) {
    batch next{};
    const bool more = it + 1 < o.iterations;
    model.step(current.seq, [&] {
      if (more) next = load(next_seq());
    });
    kit.free(current.tokens);
    kit.free(current.labels);
    kit.clip_grad_norm();
    kit.adamw_step();
    kit.zero_grad();
    current = next;
  }
}

}  // namespace spillway::trace
