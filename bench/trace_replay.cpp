// spillway-replay: plays alloc/free traces (docs/trace_format.md) against spillway's allocator and
// reports what it reserved: peak allocated, peak reserved, their ratio (fragmentation), segments,
// OOMs, retries and replay time — and, for traces recorded under PyTorch, PyTorch's own peak
// reserved bytes and ratio side by side.
//
//   spillway-replay [--trace FILE[,FILE...]] [--device auto|sim|cuda] [--capacity BYTES]
//                   [--budget BYTES] [--expandable] [--json] [--smoke]
//
// Without --trace it replays every bench/traces/*.trace.gz of the source tree. The simulated
// device gets the capacity in the trace's header (80 GiB when the header says 0), or --capacity. --smoke generates three tiny
// synthetic traces in memory, round-trips them through the text format and replays them, checking
// that the figures are sane; ctest runs it.
//
// Exit status: 0 when every trace replayed (OOMs are results, not failures); 1 when a replay
// failed or a smoke check did not hold; 2 on bad arguments or a bad trace file.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "bench_common.hpp"
#include "spillway/errors.hpp"
#include "trace_models.hpp"
#include "trace_player.hpp"

#ifndef SPILLWAY_TRACES_DIR
#define SPILLWAY_TRACES_DIR ""
#endif

namespace spillway::trace {
namespace {

void print_usage() {
  std::fputs(
      "usage: spillway-replay [--trace FILE[,FILE...]] [--device auto|sim|cuda] [--capacity BYTES]\n"
      "                       [--budget BYTES] [--expandable] [--json] [--smoke]\n"
      "  --trace       trace files (.trace or .trace.gz); default: every *.trace.gz in\n"
      "                " SPILLWAY_TRACES_DIR "\n"
      "  --device      auto (default): the GPU if there is one, else the simulated device\n"
      "  --capacity    simulated device size (default: the trace header's device_capacity,\n"
      "                or 80GiB when it is 0)\n"
      "  --budget      reserved-bytes cap, e.g. 8GiB (default: none)\n"
      "  --expandable  expandable segments (VMM)\n"
      "  --json        machine-readable results on stdout\n"
      "  --smoke       replay three tiny synthetic traces and check the figures (for ctest)\n",
      stdout);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::size_t b = 0;
  while (b <= s.size()) {
    const std::size_t e = std::min(s.find(',', b), s.size());
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

std::vector<std::string> default_traces() {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path dir = SPILLWAY_TRACES_DIR;
  if (!dir.empty() && fs::is_directory(dir, ec)) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() > 9 && name.compare(name.size() - 9, 9, ".trace.gz") == 0) out.push_back(entry.path().string());
    }
  }
  std::sort(out.begin(), out.end());
  if (out.empty()) {
    throw spillway::invalid_argument("no --trace given and no *.trace.gz in \"" + dir.string() + "\"");
  }
  return out;
}

struct named_result {
  std::string name;
  replay_result result;
};

std::string human_bytes(std::int64_t b) { return format_bytes(static_cast<std::size_t>(std::max<std::int64_t>(b, 0))); }

void print_table(const replay_options& o, const std::vector<named_result>& results) {
  const replay_result& first = results.front().result;
  std::printf("spillway-replay on %s (%s), capacity %s; budget %s; expandable segments %s\n",
              first.device_name.c_str(), first.device_why.c_str(), format_bytes(first.capacity).c_str(),
              o.budget == unlimited_budget ? "none" : format_bytes(o.budget).c_str(), o.expandable ? "on" : "off");
  std::printf("%-28s %9s %12s %12s %8s %9s %8s %6s %8s %10s\n", "trace", "events", "peak alloc",
              "peak reserv", "ratio", "segments", "dev-alloc", "OOMs", "retries", "replay");
  for (const auto& [name, r] : results) {
    std::string shown = std::filesystem::path(name).filename().string();
    if (shown.size() > 28) shown = shown.substr(0, 25) + "...";
    const double us = r.seconds * 1e6;
    std::printf("%-28s %9llu %12s %12s %8.3f %9lld %8lld %6llu %8lld %8.1f ms (%.0f ns/event)\n", shown.c_str(),
                static_cast<unsigned long long>(r.trace.events), human_bytes(r.peak_allocated).c_str(),
                human_bytes(r.peak_reserved).c_str(), r.fragmentation(), static_cast<long long>(r.peak_segments),
                static_cast<long long>(r.device_allocs), static_cast<unsigned long long>(r.ooms),
                static_cast<long long>(r.alloc_retries), us / 1e3,
                r.trace.events ? r.seconds * 1e9 / static_cast<double>(r.trace.events) : 0.0);
    if (r.torch_peak_reserved) {
      std::printf("%-28s %9s %12s %12s %8.3f   (PyTorch, recorded)\n", "", "", "",
                  format_bytes(*r.torch_peak_reserved).c_str(), r.torch_fragmentation().value_or(0));
    }
    if (r.warnings) {
      std::printf("  %llu allocator warning(s), first: %s\n", static_cast<unsigned long long>(r.warnings),
                  r.first_warnings.front().c_str());
    }
  }
  std::printf("ratio = peak reserved / peak allocated (1.000: no fragmentation); figures from the %s device\n",
              first.device_kind == "sim" ? "simulated" : "CUDA");
}

void print_json(const replay_options& o, const std::vector<named_result>& results, bool smoke) {
  bench::json_writer j(std::cout);
  const replay_result& first = results.front().result;
  j.begin_object();
  j.field("tool", "spillway-replay");
  j.field("smoke", smoke);
  j.key("device").begin_object();
  j.field("kind", first.device_kind).field("name", first.device_name).field("why", first.device_why);
  j.field("capacity", static_cast<std::uint64_t>(first.capacity));
  j.end_object();
  j.key("config").begin_object();
  j.key("budget");
  if (o.budget == unlimited_budget) {
    j.value("none");
  } else {
    j.value(static_cast<std::uint64_t>(o.budget));
  }
  j.field("expandable_segments", o.expandable);
  j.end_object();
  j.key("traces").begin_array();
  for (const auto& [name, r] : results) {
    j.begin_object();
    j.field("trace", name);
    j.field("events", r.trace.events).field("allocs", r.trace.allocs).field("frees", r.trace.frees);
    j.field("record_streams", r.trace.record_streams);
    j.field("trace_peak_live_bytes", r.trace.peak_live_bytes);
    j.field("peak_allocated", r.peak_allocated).field("peak_reserved", r.peak_reserved);
    j.field("peak_requested", r.peak_requested);
    j.field("fragmentation", r.fragmentation());
    j.field("peak_segments", r.peak_segments).field("device_allocs", r.device_allocs);
    j.field("ooms", r.ooms).field("skipped_events", r.skipped).field("alloc_retries", r.alloc_retries);
    j.field("warnings", r.warnings);
    j.field("replay_seconds", r.seconds);
    j.field("ns_per_event", r.trace.events ? r.seconds * 1e9 / static_cast<double>(r.trace.events) : 0.0);
    if (r.torch_peak_reserved) {
      j.key("torch").begin_object();
      j.field("peak_reserved", static_cast<std::uint64_t>(*r.torch_peak_reserved));
      j.field("fragmentation", r.torch_fragmentation().value_or(0));
      j.end_object();
    }
    j.end_object();
  }
  j.end_array();
  j.end_object();
}

// Tiny traces of each model, through the text format and back.
std::vector<std::pair<std::string, trace_data>> smoke_traces() {
  synth_options t;
  t.model = "transformer";
  t.iterations = 2, t.layers = 2, t.batch = 2, t.seq = 128, t.hidden = 256, t.heads = 4, t.vocab = 1000;
  synth_options c;
  c.model = "cnn";
  c.iterations = 2, c.layers = 4, c.batch = 4, c.image = 64, c.width = 16;
  synth_options r;
  r.model = "random";
  r.events = 2000, r.streams = 3, r.live_bytes = std::size_t{64} << 20;
  std::vector<std::pair<std::string, trace_data>> out;
  for (const synth_options& o : {t, c, r}) {
    synth_options sized = o;
    sized.device_capacity = std::size_t{8} << 30;
    const trace_data made = synthesize(sized);
    trace_data back = parse_trace(to_text(made), "smoke:" + o.model);
    if (!(back == made)) throw std::runtime_error("smoke: the " + o.model + " trace did not survive the text format");
    out.emplace_back("smoke:" + o.model, std::move(back));
  }
  return out;
}

// What must hold for any replay without a budget: returns the failed checks.
std::vector<std::string> smoke_checks(const named_result& n) {
  const replay_result& r = n.result;
  std::vector<std::string> failed;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) failed.push_back(n.name + ": " + what);
  };
  check(r.ooms == 0, "no out-of-memory (the simulated device has 8 GiB)");
  check(r.peak_allocated > 0, "peak allocated > 0");
  check(r.peak_allocated >= static_cast<std::int64_t>(r.trace.peak_live_bytes), "peak allocated >= peak live requested bytes");
  check(r.peak_reserved >= r.peak_allocated, "peak reserved >= peak allocated");
  check(r.warnings == 0, "no allocator warnings");
  return failed;
}

int run(int argc, char** argv) {
  bench::arg_parser args(argc, argv);
  if (args.flag("help")) {
    print_usage();
    return 0;
  }
  replay_options o;
  const std::string trace_arg = args.get("trace", "");
  o.device = args.get("device", "auto");
  o.capacity = args.get_bytes("capacity", 0);
  o.budget = args.get_bytes("budget", unlimited_budget);
  o.expandable = args.flag("expandable");
  const bool json = args.flag("json");
  const bool smoke = args.flag("smoke");
  args.finish();
  if (smoke && !trace_arg.empty()) throw spillway::invalid_argument("--smoke and --trace do not go together");

  std::vector<std::pair<std::string, trace_data>> traces;
  if (smoke) {
    traces = smoke_traces();
  } else {
    for (const std::string& path : trace_arg.empty() ? default_traces() : split_commas(trace_arg)) {
      traces.emplace_back(path, read_trace(path));
    }
  }
  std::vector<named_result> results;
  for (const auto& [name, trace] : traces) results.push_back({name, replay(trace, o)});

  if (json) {
    print_json(o, results, smoke);
  } else {
    print_table(o, results);
  }
  if (smoke) {
    std::vector<std::string> failed;
    for (const auto& n : results) {
      for (auto& f : smoke_checks(n)) failed.push_back(std::move(f));
    }
    for (const auto& f : failed) std::fprintf(stderr, "spillway-replay --smoke: FAILED %s\n", f.c_str());
    if (!failed.empty()) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace spillway::trace

int main(int argc, char** argv) {
  return spillway::bench::run_tool("spillway-replay", spillway::trace::run, argc, argv);
}
