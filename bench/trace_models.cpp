// trace_models: option checks and dispatch to the models. The contract is in trace_models.hpp.
#include "trace_models.hpp"

#include <cstdio>

#include "spillway/errors.hpp"
#include "trace_builder.hpp"

namespace spillway::trace {

// One function per model, in its own file (trace_model_*.cpp).
void synthesize_transformer(const synth_options& o, double jitter, trace_builder& builder);
void synthesize_cnn(const synth_options& o, double jitter, trace_builder& builder);
void synthesize_random(const synth_options& o, trace_builder& builder);

namespace {

void require(bool ok, const std::string& option, long long value, const std::string& expected) {
  if (!ok) {
    throw spillway::invalid_argument("--" + option + " " + std::to_string(value) + ": expected " + expected);
  }
}

// Fills the model defaults and checks every option the model uses.
synth_options resolved(const synth_options& in) {
  synth_options o = in;
  const bool transformer = o.model == "transformer", cnn = o.model == "cnn";
  if (!transformer && !cnn && o.model != "random") {
    throw spillway::invalid_argument("--model " + o.model + ": expected transformer, cnn or random");
  }
  if (o.layers == 0) o.layers = transformer ? 12 : 8;
  if (o.batch == 0) o.batch = transformer ? 8 : 32;
  if (!o.jitter) o.jitter = transformer ? 0.25 : 0.0;
  if (*o.jitter < 0 || *o.jitter > 0.9) {
    throw spillway::invalid_argument("--jitter " + std::to_string(*o.jitter) + ": expected 0 to 0.9");
  }
  require(o.iterations >= 1 && o.iterations <= 10000, "iterations", o.iterations, "1 to 10000");
  require(o.layers >= 1 && o.layers <= 1000, "layers", o.layers, "1 to 1000");
  require(o.batch >= 1 && o.batch <= 65536, "batch", o.batch, "1 to 65536");
  require(o.dtype_bytes == 1 || o.dtype_bytes == 2 || o.dtype_bytes == 4, "dtype-bytes", o.dtype_bytes, "1, 2 or 4");
  if (transformer) {
    require(o.seq >= 8 && o.seq <= (1 << 20), "seq", o.seq, "8 to 1048576");
    require(o.hidden >= 8 && o.hidden <= (1 << 16), "hidden", o.hidden, "8 to 65536");
    require(o.heads >= 1 && o.hidden % o.heads == 0, "heads", o.heads, "a divisor of --hidden");
    require(o.vocab >= 1 && o.vocab <= (1 << 22), "vocab", o.vocab, "1 to 4194304");
  }
  if (cnn) {
    require(o.image >= 32 && o.image <= 8192, "image", o.image, "32 to 8192");
    require(o.width >= 1 && o.width <= 4096, "width", o.width, "1 to 4096");
  }
  if (o.model == "random") {
    require(o.events >= 1 && o.events <= 100'000'000, "events", static_cast<long long>(o.events), "1 to 100000000");
    require(o.streams >= 1 && o.streams <= 64, "streams", o.streams, "1 to 64");
    require(o.live_bytes >= (1u << 20), "live-bytes", static_cast<long long>(o.live_bytes), "at least 1 MiB");
  }
  return o;
}

}  // namespace

std::string describe(const synth_options& in) {
  const synth_options o = resolved(in);
  std::string s = "synth:" + o.model;
  auto add = [&](const std::string& k, long long v) { s += ":" + k + std::to_string(v); };
  if (o.model == "random") {
    add("events", static_cast<long long>(o.events));
    add("streams", o.streams);
    add("live", static_cast<long long>(o.live_bytes));
  } else {
    add("it", o.iterations);
    add("L", o.layers);
    add("B", o.batch);
    if (o.model == "transformer") {
      add("S", o.seq);
      add("H", o.hidden);
      add("heads", o.heads);
      add("V", o.vocab);
      if (o.math_attention) s += ":math";
    } else {
      add("img", o.image);
      add("w", o.width);
    }
    add("P", o.dtype_bytes);
    char jitter[32];
    std::snprintf(jitter, sizeof jitter, ":jitter%.2f", *o.jitter);
    s += jitter;
  }
  add("seed", static_cast<long long>(o.seed));
  return s;
}

trace_data synthesize(const synth_options& in) {
  const synth_options o = resolved(in);
  header h;
  h.device_capacity = o.device_capacity;
  h.source = describe(o);
  trace_builder builder(std::move(h));
  if (o.model == "transformer") {
    synthesize_transformer(o, *o.jitter, builder);
  } else if (o.model == "cnn") {
    synthesize_cnn(o, *o.jitter, builder);
  } else {
    synthesize_random(o, builder);
  }
  return builder.finish();
}

}  // namespace spillway::trace
