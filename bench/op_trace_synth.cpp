// op_trace_synth: the synthetic models. Shapes and costs are described in op_trace_synth.hpp; the
// backward comes from step_builder (op_trace_builder.hpp).
#include "op_trace_synth.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "op_trace_builder.hpp"
#include "spillway/errors.hpp"

namespace spillway::op_trace {
namespace {

using value = step_builder::value;
using u64 = std::uint64_t;

struct device_model {
  const synth_options& o;
  u64 flops(double f) const { return std::max(o.min_op_ns, static_cast<u64>(f / o.flops_per_ns)); }
  u64 matmul(double m, double n, double k) const { return flops(2 * m * n * k); }
  u64 conv(double b, double cin, double cout, double hw_out, double k) const {
    return flops(2 * b * cin * cout * hw_out * k * k);
  }
  u64 moved(double bytes) const { return std::max(o.min_op_ns, static_cast<u64>(bytes / o.bytes_per_ns)); }
};

int or_default(int v, int fallback) { return v > 0 ? v : fallback; }

// --- mlp ---------------------------------------------------------------------------------------

trace_data mlp(const synth_options& o) {
  const device_model d{o};
  step_builder s(o.bytes_per_ns, o.min_op_ns);
  const int layers = or_default(o.layers, 32);
  const u64 batch = static_cast<u64>(or_default(o.batch, 8192));
  const int width = or_default(o.width, 640);
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int> pick(std::max(1, width / 128), std::max(1, width / 32));  // x 64: width/2 .. 2 width
  std::vector<u64> w(static_cast<std::size_t>(layers) + 1);
  for (u64& x : w) x = o.shared_weights ? static_cast<u64>(width) : static_cast<u64>(64 * pick(rng));
  value x = s.input(batch * w[0] * 4);
  const value shared = o.shared_weights ? s.weight(w[0] * w[0] * 4) : 0;
  for (int i = 1; i <= layers; ++i) {
    const u64 in = w[static_cast<std::size_t>(i) - 1], out = w[static_cast<std::size_t>(i)];
    const value weight = o.shared_weights ? shared : s.weight(in * out * 4);
    const u64 f = d.matmul(static_cast<double>(batch), static_cast<double>(out), static_cast<double>(in)) +
                  d.moved(static_cast<double>(batch * out * 4));
    x = s.op1(std::string("fc") + std::to_string(i), f, {x, weight}, batch * out * 4, saved::both, 2 * f);
  }
  const value y = s.input(batch * w.back() * 4);
  const value loss = s.op1("loss", d.moved(2.0 * static_cast<double>(s.bytes(x))), {x, y}, 4, saved::inputs,
                           d.moved(3.0 * static_cast<double>(s.bytes(x))));
  return s.finish(loss, "mlp", "synth:" + describe(o));
}

// --- transformer -------------------------------------------------------------------------------

trace_data transformer(const synth_options& o) {
  const device_model d{o};
  step_builder s(o.bytes_per_ns, o.min_op_ns);
  const int layers = or_default(o.layers, 6);
  const double b = or_default(o.batch, 4), t = 512, h = or_default(o.width, 768), heads = 12, vocab = 8192;
  const auto bytes = [](double elements) { return static_cast<u64>(elements * 4); };
  const u64 act = bytes(b * t * h);
  const value ids = s.input(static_cast<u64>(b * t * 8));
  const value labels = s.input(static_cast<u64>(b * t * 8));
  const value pad = s.input(static_cast<u64>(b * t * 8));
  const value embedding = s.weight(bytes(vocab * h));
  const value positions = s.weight(bytes(t * h));
  value x = s.op1("embed", d.moved(2.0 * act), {ids, embedding, positions}, act, saved::inputs, d.moved(3.0 * act));
  // The causal + padding mask: computed once, read by every block (a constant for rotor).
  const value mask = s.op1("mask", d.moved(b * t * t * 4), {pad}, bytes(b * t * t), saved::nothing, 0);
  const auto layer_norm = [&](const std::string& name, value in) {
    const value gamma = s.weight(bytes(2 * h));
    return s.op(name, d.moved(2.0 * act), {in, gamma}, {act, static_cast<u64>(b * t * 8)}, saved::inputs,
                d.moved(4.0 * act)).front();
  };
  const auto linear = [&](const std::string& name, value in, double n_in, double n_out) {
    const value w = s.weight(bytes(n_in * n_out));
    const u64 f = d.matmul(b * t, n_out, n_in);
    return s.op1(name, f, {in, w}, bytes(b * t * n_out), saved::inputs, 2 * f);
  };
  for (int l = 0; l < layers; ++l) {
    const std::string p = std::string("h") + std::to_string(l) + ".";
    const value a = layer_norm(p + "ln1", x);
    const value qkv = linear(p + "qkv", a, h, 3 * h);
    const u64 score_bytes = bytes(b * heads * t * t);
    const u64 attn = d.flops(2 * b * t * t * h);
    const value scores = s.op1(p + "scores", attn, {qkv}, score_bytes, saved::inputs, 2 * attn);
    const value probs = s.op1(p + "softmax", d.moved(2.0 * score_bytes), {scores, mask}, score_bytes, saved::outputs,
                              d.moved(3.0 * score_bytes));
    const value ctx = s.op1(p + "attn_v", attn, {probs, qkv}, act, saved::inputs, 2 * attn);
    const value proj = linear(p + "proj", ctx, h, h);
    const value x1 = s.op1(p + "res1", d.moved(3.0 * act), {x, proj}, act, saved::nothing, d.moved(2.0 * act));
    const value c = layer_norm(p + "ln2", x1);
    const value up = linear(p + "fc1", c, h, 4 * h);
    const value g = s.op1(p + "gelu", d.moved(8.0 * act), {up}, 4 * act, saved::inputs, d.moved(12.0 * act));
    const value down = linear(p + "fc2", g, 4 * h, h);
    x = s.op1(p + "res2", d.moved(3.0 * act), {x1, down}, act, saved::nothing, d.moved(2.0 * act));
  }
  const value xf = layer_norm("ln_f", x);
  const u64 head = d.matmul(b * t, vocab, h);
  const value logits = s.op1("lm_head", head, {xf, embedding}, bytes(b * t * vocab), saved::inputs, 2 * head);
  const value loss = s.op1("loss", d.moved(2.0 * static_cast<double>(s.bytes(logits))), {logits, labels}, 4,
                           saved::inputs, d.moved(3.0 * static_cast<double>(s.bytes(logits))));
  return s.finish(loss, "transformer", "synth:" + describe(o));
}

// --- convolutional nets ------------------------------------------------------------------------

// conv / batch norm / relu / pooling on NCHW float32 tensors.
struct conv_kit {
  step_builder& s;
  device_model d;
  double b;

  u64 bytes(double c, double hw) const { return static_cast<u64>(b * c * hw * 4); }
  value conv(const std::string& n, value x, double cin, double cout, double hw_out, double k) {
    const value w = s.weight(static_cast<u64>(cin * cout * k * k * 4));
    const u64 f = d.conv(b, cin, cout, hw_out, k);
    return s.op1(n, f, {x, w}, bytes(cout, hw_out), saved::inputs, 2 * f);
  }
  value bn(const std::string& n, value x, double c, double hw) {
    const value gamma = s.weight(static_cast<u64>(2 * c * 4));
    const double moved = 2.0 * static_cast<double>(bytes(c, hw));
    return s.op(n, d.moved(moved), {x, gamma}, {bytes(c, hw), static_cast<u64>(2 * c * 4)}, saved::inputs,
                d.moved(1.5 * moved)).front();
  }
  value relu(const std::string& n, value x) {
    const double moved = 2.0 * static_cast<double>(s.bytes(x));
    return s.op1(n, d.moved(moved), {x}, s.bytes(x), saved::outputs, d.moved(1.5 * moved));
  }
  value cbr(const std::string& n, value x, double cin, double cout, double hw_out, double k, bool with_relu = true) {
    const value y = bn(n + ".bn", conv(n + ".conv", x, cin, cout, hw_out, k), cout, hw_out);
    return with_relu ? relu(n + ".relu", y) : y;
  }
  value max_pool(const std::string& n, value x, double c, double hw_out) {
    const u64 out = bytes(c, hw_out);
    return s.op(n, d.moved(static_cast<double>(s.bytes(x) + out)), {x}, {out, 2 * out}, saved::inputs,
                d.moved(static_cast<double>(s.bytes(x) + 3 * out))).front();
  }
  value add(const std::string& n, value a, value c) {
    const double moved = 3.0 * static_cast<double>(s.bytes(a));
    return s.op1(n, d.moved(moved), {a, c}, s.bytes(a), saved::nothing, d.moved(moved * 2 / 3));
  }
  value loss(value x, value target) {
    const double moved = 2.0 * static_cast<double>(s.bytes(x));
    return s.op1("loss", d.moved(moved), {x, target}, 4, saved::inputs, d.moved(1.5 * moved));
  }
};

trace_data resnet(const synth_options& o) {
  step_builder s(o.bytes_per_ns, o.min_op_ns);
  conv_kit k{s, {o}, static_cast<double>(or_default(o.batch, 8))};
  const int blocks = or_default(o.layers, 16);
  const int shape[4] = {3, 4, 6, 3};
  value x = s.input(k.bytes(3, 224 * 224));
  x = k.cbr("stem", x, 3, 64, 112 * 112, 7);
  x = k.max_pool("pool", x, 64, 56 * 56);
  double cin = 64, hw = 56 * 56;
  for (int st = 0; st < 4; ++st) {
    const int n = std::max(1, static_cast<int>(std::lround(shape[st] * blocks / 16.0)));
    const double mid = 64 << st, out = 4 * mid;
    for (int i = 0; i < n; ++i) {
      const std::string p = std::string("s") + std::to_string(st + 1) + std::string("b") + std::to_string(i) + ".";
      const double hw_out = (i == 0 && st > 0) ? hw / 4 : hw;
      value y = k.cbr(p + "a", x, cin, mid, hw, 1);
      y = k.cbr(p + "b", y, mid, mid, hw_out, 3);
      y = k.cbr(p + "c", y, mid, out, hw_out, 1, false);
      const value skip = i == 0 ? k.cbr(p + "proj", x, cin, out, hw_out, 1, false) : x;
      x = k.relu(p + "relu", k.add(p + "add", y, skip));
      cin = out;
      hw = hw_out;
    }
  }
  const value pooled = s.op1("avgpool", k.d.moved(static_cast<double>(s.bytes(x))), {x}, k.bytes(cin, 1),
                             saved::nothing, k.d.moved(static_cast<double>(s.bytes(x))));
  const value fc_w = s.weight(static_cast<u64>(cin * 1000 * 4));
  const u64 f = k.d.matmul(k.b, 1000, cin);
  const value logits = s.op1("fc", f, {pooled, fc_w}, k.bytes(1000, 1), saved::inputs, 2 * f);
  return s.finish(k.loss(logits, s.input(static_cast<u64>(k.b * 8))), "resnet", "synth:" + describe(o));
}

trace_data unet(const synth_options& o) {
  step_builder s(o.bytes_per_ns, o.min_op_ns);
  conv_kit k{s, {o}, static_cast<double>(or_default(o.batch, 4))};
  const int levels = or_default(o.layers, 4);
  const double base = or_default(o.width, 32);
  double hw = 256 * 256, c = 3;
  value x = s.input(k.bytes(3, hw));
  const auto double_conv = [&](const std::string& n, value in, double cin, double cout) {
    return k.cbr(n + ".2", k.cbr(n + ".1", in, cin, cout, hw, 3), cout, cout, hw, 3);
  };
  std::vector<std::pair<value, double>> skips;  // (tensor, channels)
  for (int l = 0; l < levels; ++l) {
    const double w = base * (1 << l);
    x = double_conv(std::string("down") + std::to_string(l), x, c, w);
    skips.emplace_back(x, w);
    hw /= 4;
    x = k.max_pool(std::string("pool") + std::to_string(l), x, w, hw);
    c = w;
  }
  x = double_conv("bottom", x, c, 2 * c);
  c *= 2;
  for (int l = levels - 1; l >= 0; --l) {
    const auto [skip, w] = skips[static_cast<std::size_t>(l)];
    hw *= 4;
    const value u = k.conv(std::string("up") + std::to_string(l) + ".tconv", x, c, w, hw, 2);
    const u64 cat_bytes = s.bytes(u) + s.bytes(skip);
    const value cat = s.op1(std::string("up") + std::to_string(l) + ".cat", k.d.moved(2.0 * static_cast<double>(cat_bytes)),
                            {u, skip}, cat_bytes, saved::nothing, k.d.moved(2.0 * static_cast<double>(cat_bytes)));
    x = double_conv(std::string("up") + std::to_string(l), cat, 2 * w, w);
    c = w;
  }
  const value head = k.conv("head", x, c, 1, hw, 1);
  return s.finish(k.loss(head, s.input(k.bytes(1, hw))), "unet", "synth:" + describe(o));
}

}  // namespace

std::vector<std::string> synth_models() { return {"mlp", "transformer", "resnet", "unet"}; }

trace_data synthesize(const synth_options& o) {
  if (o.flops_per_ns <= 0 || o.bytes_per_ns <= 0) throw spillway::invalid_argument("synthesize: speeds must be > 0");
  if (o.model == "mlp") return mlp(o);
  if (o.model == "transformer") return transformer(o);
  if (o.model == "resnet") return resnet(o);
  if (o.model == "unet") return unet(o);
  throw spillway::invalid_argument("unknown synthetic model \"" + o.model + "\"; expected mlp, transformer, resnet or unet");
}

synth_options parse_synth_spec(const std::string& spec) {
  synth_options o;
  const std::size_t colon = spec.find(':');
  o.model = spec.substr(0, colon);
  if (colon == std::string::npos) return o;
  std::stringstream rest(spec.substr(colon + 1));
  std::string item;
  while (std::getline(rest, item, ',')) {
    const std::size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), val = eq == std::string::npos ? "" : item.substr(eq + 1);
    long long n = -1;
    try {
      std::size_t used = 0;
      n = std::stoll(val, &used);
      if (used != val.size()) n = -1;
    } catch (const std::exception&) {
      n = -1;
    }
    if (n < 0 || n > (1LL << 31)) {
      throw spillway::invalid_argument("synthetic trace \"" + spec + "\": option \"" + item +
                                       "\" needs a whole number, e.g. layers=8");
    }
    if (key == "layers") {
      o.layers = static_cast<int>(n);
    } else if (key == "batch") {
      o.batch = static_cast<int>(n);
    } else if (key == "width") {
      o.width = static_cast<int>(n);
    } else if (key == "shared") {
      o.shared_weights = n != 0;
    } else if (key == "seed") {
      o.seed = static_cast<std::uint64_t>(n);
    } else {
      throw spillway::invalid_argument("synthetic trace \"" + spec + "\": unknown option \"" + key +
                                       "\" (expected layers, batch, width, shared, seed)");
    }
  }
  return o;
}

std::string describe(const synth_options& o) {
  std::string s = o.model;
  std::string opts;
  const auto add = [&](const char* k, long long v) {
    if (!opts.empty()) opts += ',';
    opts += k;
    opts += '=';
    opts += std::to_string(v);
  };
  if (o.layers > 0) add("layers", o.layers);
  if (o.batch > 0) add("batch", o.batch);
  if (o.width > 0) add("width", o.width);
  if (o.shared_weights) add("shared", 1);
  if (o.seed != 1) add("seed", static_cast<long long>(o.seed));
  return opts.empty() ? s : s + ":" + opts;
}

}  // namespace spillway::op_trace
