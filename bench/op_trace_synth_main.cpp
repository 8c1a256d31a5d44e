// spillway-op-trace-synth: writes synthetic operator traces (op_trace_synth.hpp) in the op-trace
// format (docs/op_trace_format.md), and summarises op traces.
//
//   spillway-op-trace-synth --model SPEC --out FILE     e.g. --model mlp:layers=32 --out mlp.optrace
//   spillway-op-trace-synth --summary FILE              ops, buffers, peak live bytes of a trace
//   spillway-op-trace-synth --smoke                     every model through the text form (ctest)
//
// SPEC: mlp | transformer | resnet | unet, optionally followed by :key=value,... with keys layers,
// batch, width, shared (mlp: one weight for all layers), seed. A path ending in .gz is compressed.
#include <cstdio>

#include "bench_common.hpp"
#include "op_trace.hpp"
#include "op_trace_synth.hpp"
#include "spillway/errors.hpp"

namespace spillway::op_trace {
namespace {

void print_summary(const std::string& name, const trace_data& t) {
  const trace_summary s = summarize(t);
  std::printf("%s: model %s, source %s\n  %zu ops (%zu forward, %zu backward), %zu buffers (%zu params, %s)\n"
              "  peak live %s (%zu buffers), compute %.3f ms (forward %.3f ms)\n",
              name.c_str(), t.model.c_str(), t.source.c_str(), s.ops, s.forward_ops, s.backward_ops, s.buffers,
              s.params, format_bytes(s.param_bytes).c_str(), format_bytes(s.peak_live_bytes).c_str(),
              s.peak_live_buffers, static_cast<double>(s.total_duration_ns) / 1e6,
              static_cast<double>(s.forward_duration_ns) / 1e6);
}

int run(int argc, char** argv) {
  bench::arg_parser args(argc, argv);
  if (args.flag("help")) {
    std::puts("usage: spillway-op-trace-synth --model SPEC --out FILE | --summary FILE | --smoke");
    return 0;
  }
  const std::string model = args.get("model", "");
  const std::string out = args.get("out", "");
  const std::string summary = args.get("summary", "");
  const bool smoke = args.flag("smoke");
  args.finish();
  if (smoke) {
    for (const std::string& m : synth_models()) {
      synth_options o;
      o.model = m;
      o.layers = 2;
      o.batch = 1;
      const trace_data t = synthesize(o);
      if (!(parse_op_trace(to_text(t), m) == t)) {
        std::fprintf(stderr, "spillway-op-trace-synth --smoke: %s does not survive the text form\n", m.c_str());
        return 1;
      }
      print_summary("synth:" + describe(o), t);
    }
    std::puts("smoke: ok");
    return 0;
  }
  if (!summary.empty()) {
    print_summary(summary, read_op_trace(summary));
    return 0;
  }
  if (model.empty() || out.empty()) throw spillway::invalid_argument("give --model SPEC and --out FILE (or --summary FILE)");
  const trace_data t = synthesize(parse_synth_spec(model));
  write_op_trace(t, out);
  print_summary(out, t);
  return 0;
}

}  // namespace
}  // namespace spillway::op_trace

int main(int argc, char** argv) {
  return spillway::bench::run_tool("spillway-op-trace-synth", spillway::op_trace::run, argc, argv);
}
