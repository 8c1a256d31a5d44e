// spillway-trace-synth: writes a synthetic alloc/free trace shaped like a training job
// (trace_models.hpp describes the models; docs/trace_format.md the format).
//
//   spillway-trace-synth --model transformer|cnn|random -o FILE [options]
//
// FILE ending in .gz is gzip-compressed; "-o -" writes plain text to stdout. The same options and
// --seed always give the same trace. --json prints a summary of the trace (events, peak live
// bytes, ...) on stdout; without -o that is all it does. --smoke generates every model small,
// checks that each survives the text format unchanged and is deterministic, and exits 0 (ctest;
// with --json the outcome is a JSON object).
// --device is accepted and ignored: bench/gpu_suite.sh passes "--device cuda --json" to every
// tool in build/bench, and generating a trace needs no device.
//
// Exit status: 0 on success, 1 when a smoke check fails, 2 on bad arguments (an output file that
// cannot be written included).
#include <cmath>
#include <cstdio>
#include <iostream>
#include <vector>

#include "bench_common.hpp"
#include "spillway/errors.hpp"
#include "trace_models.hpp"

namespace spillway::trace {
namespace {

void print_usage() {
  std::fputs(
      "usage: spillway-trace-synth --model transformer|cnn|random [-o FILE] [--json] [options]\n"
      "  -o FILE            output (.trace.gz compressed, .trace plain, - for stdout)\n"
      "  --seed N           (default 1)\n"
      "  --iterations N     training steps (default 4)\n"
      "  --layers N         transformer blocks (12) / ResNet basic blocks (8)\n"
      "  --batch N          (transformer 8, cnn 32)\n"
      "  --dtype-bytes N    activation element size: 2 (bf16/fp16 autocast, default) or 4\n"
      "  --jitter F         0..0.9 shape variation per step: sequence length (transformer,\n"
      "                     default 0.25) or image side (cnn, default 0)\n"
      "  transformer: --seq N (512) --hidden N (1024) --heads N (16) --vocab N (32000)\n"
      "               --math-attention (materialise S x S attention instead of flash)\n"
      "  cnn:         --image N (224) --width N (64)\n"
      "  random:      --events N (20000) --streams N (2) --live-bytes BYTES (2GiB)\n"
      "  --capacity BYTES   device_capacity written to the header (default 80GiB): the size of\n"
      "                     the simulated device that spillway-replay uses\n"
      "  --json             a summary of the trace on stdout\n"
      "  --smoke            generate every model small, check the round trip (for ctest)\n",
      stdout);
}

void print_summary_json(const trace_data& t, const std::string& output) {
  const trace_summary s = summarize(t);
  bench::json_writer j(std::cout);
  j.begin_object();
  j.field("tool", "spillway-trace-synth");
  j.field("source", t.head.source);
  j.key("output");
  if (output.empty()) {
    j.value("none");
  } else {
    j.value(output);
  }
  j.field("device_capacity", static_cast<std::uint64_t>(t.head.device_capacity));
  j.field("events", s.events).field("allocs", s.allocs).field("frees", s.frees);
  j.field("record_streams", s.record_streams).field("streams", static_cast<std::uint64_t>(s.streams));
  j.field("bytes_requested", s.bytes_requested).field("peak_live_bytes", s.peak_live_bytes);
  j.field("peak_live_allocations", s.peak_live_allocations).field("live_at_end", s.live_at_end);
  j.field("duration_ns", s.duration_ns);
  j.end_object();
}

// Every model, small: deterministic, survives the text format, not empty. With `json`, one JSON
// object on stdout instead of the table.
int smoke(bool json) {
  struct outcome {
    std::string model;
    trace_summary summary;
    bool deterministic, round_trip, nonempty;
  };
  std::vector<outcome> outcomes;
  for (const char* model : {"transformer", "cnn", "random"}) {
    synth_options o;
    o.model = model;
    o.iterations = 2, o.layers = 2, o.batch = 2, o.seq = 64, o.hidden = 128, o.heads = 4, o.vocab = 500;
    o.image = 64, o.width = 8, o.events = 1000, o.live_bytes = std::size_t{32} << 20;
    const trace_data a = synthesize(o);
    const trace_summary s = summarize(a);
    outcomes.push_back({model, s, a == synthesize(o), parse_trace(to_text(a), model) == a,
                        s.allocs > 0 && s.frees > 0 && s.peak_live_bytes > 0});
  }
  bool ok = true;
  for (const outcome& r : outcomes) ok = ok && r.deterministic && r.round_trip && r.nonempty;
  if (json) {
    bench::json_writer j(std::cout);
    j.begin_object().field("tool", "spillway-trace-synth").field("smoke", true).field("passed", ok);
    j.key("models").begin_array();
    for (const outcome& r : outcomes) {
      j.begin_object().field("model", r.model).field("events", r.summary.events);
      j.field("peak_live_bytes", r.summary.peak_live_bytes).field("deterministic", r.deterministic);
      j.field("round_trip", r.round_trip).field("nonempty", r.nonempty).end_object();
    }
    j.end_array().end_object();
  } else {
    for (const outcome& r : outcomes) {
      std::printf("%-12s %6llu events, peak live %s: deterministic %s, round trip %s\n", r.model.c_str(),
                  static_cast<unsigned long long>(r.summary.events), format_bytes(r.summary.peak_live_bytes).c_str(),
                  r.deterministic ? "yes" : "NO", r.round_trip ? "yes" : "NO");
    }
  }
  return ok ? 0 : 1;
}

int run(int argc, char** argv) {
  bench::arg_parser args(argc, argv);
  if (args.flag("help") || args.flag("h")) {
    print_usage();
    return 0;
  }
  synth_options o;
  o.model = args.get("model", o.model);
  const std::string output = args.get("o", "");
  o.seed = static_cast<std::uint64_t>(args.get_int("seed", 1));
  o.iterations = static_cast<int>(args.get_int("iterations", o.iterations));
  o.layers = static_cast<int>(args.get_int("layers", 0));
  o.batch = static_cast<int>(args.get_int("batch", 0));
  o.dtype_bytes = static_cast<int>(args.get_int("dtype-bytes", o.dtype_bytes));
  if (const double j = args.get_double("jitter", std::nan("")); !std::isnan(j)) o.jitter = j;
  o.seq = static_cast<int>(args.get_int("seq", o.seq));
  o.hidden = static_cast<int>(args.get_int("hidden", o.hidden));
  o.heads = static_cast<int>(args.get_int("heads", o.heads));
  o.vocab = static_cast<int>(args.get_int("vocab", o.vocab));
  o.math_attention = args.flag("math-attention");
  o.image = static_cast<int>(args.get_int("image", o.image));
  o.width = static_cast<int>(args.get_int("width", o.width));
  const long long events = args.get_int("events", static_cast<long long>(o.events));
  if (events < 1) throw spillway::invalid_argument("--events " + std::to_string(events) + ": expected at least 1");
  o.events = static_cast<std::uint64_t>(events);
  o.streams = static_cast<int>(args.get_int("streams", o.streams));
  o.live_bytes = args.get_bytes("live-bytes", o.live_bytes);
  o.device_capacity = args.get_bytes("capacity", o.device_capacity);
  const bool json = args.flag("json");
  const bool smoke_mode = args.flag("smoke");
  (void)args.get("device", "");  // accepted and ignored (see the top of this file)
  args.finish();

  if (smoke_mode) return smoke(json);
  if (output.empty() && !json) {
    throw spillway::invalid_argument("give -o FILE (or -o - for stdout), or --json for a summary only");
  }
  if (output == "-" && json) throw spillway::invalid_argument("-o - and --json both write to stdout");
  const trace_data trace = synthesize(o);
  if (output == "-") {
    std::cout << to_text(trace);
  } else if (!output.empty()) {
    write_trace(trace, output);
  }
  if (json) {
    print_summary_json(trace, output);
  } else if (output != "-") {
    const trace_summary s = summarize(trace);
    std::fprintf(stderr, "spillway-trace-synth: %s -> %s: %llu events, peak live %s\n", trace.head.source.c_str(),
                 output.c_str(), static_cast<unsigned long long>(s.events), format_bytes(s.peak_live_bytes).c_str());
  }
  return 0;
}

}  // namespace
}  // namespace spillway::trace

int main(int argc, char** argv) {
  return spillway::bench::run_tool("spillway-trace-synth", spillway::trace::run, argc, argv);
}
