// spillway-evict-sim: replays operator traces (docs/op_trace_format.md) on the simulated device
// under budgets, once per eviction policy and engine mode, and reports extra compute, copy stalls,
// bytes spilled, evictions and decision time, next to rotor's optimum for chain-like traces.
// docs/simulator.md has the model, the metrics and the results.
//
//   spillway-evict-sim [--trace FILE|synth:SPEC[,...]] [--budgets 1.0,0.8,...] [--policies dtr,...]
//                      [--modes drop,hybrid,spill] [--verify] [--expandable] [--max-split-mb N]
//                      [--no-eager-drop] [--oom-layout]
//                      [--link-gbps 50] [--driver-us 0] [--sync-us 0] [--seed S] [--rotor-slots 500]
//                      [--rotor-max-stages 400]
//                      [--json [--timeline]] [--plot FILE.svg] [--smoke]
//
// Without --trace it replays every *.optrace / *.optrace.gz in bench/op_traces. A budget ratio r
// means a budget of r x the trace's unconstrained peak reserved bytes, measured by a first replay
// without an engine and without a budget.
//
// Exit status: 0 when every replay ran (an out-of-memory at some budget is a result, not a
// failure); 1 when a replay brought back wrong bytes (--verify), a run failed with an error other
// than out of memory (status "error", ERROR in the table: a bug of the engine or the replay), or a
// smoke check failed; 2 on bad arguments or a bad trace.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <thread>
#include <utility>

#include "bench_common.hpp"
#include "evict_sim_chain.hpp"
#include "evict_sim_report.hpp"
#include "evict_sim_run.hpp"
#include "op_trace.hpp"
#include "op_trace_synth.hpp"
#include "spillway/errors.hpp"
#include "spillway/eviction/policy.hpp"

#ifndef SPILLWAY_OP_TRACES_DIR
#define SPILLWAY_OP_TRACES_DIR ""
#endif

namespace spillway::evsim {
namespace {

void print_usage() {
  std::fputs(
      "usage: spillway-evict-sim [--trace FILE|synth:SPEC[,...]] [--budgets 1.0,0.8,0.6,0.5,0.4,0.3]\n"
      "                          [--policies dtr,lru,largest,dtr-frag] [--modes drop,hybrid,spill]\n"
      "                          [--verify] [--expandable] [--max-split-mb 0] [--no-eager-drop] [--no-compact] [--oom-layout]\n"
      "                          [--link-gbps 50] [--seed 1]\n"
      "                          [--max-recompute-factor 8]\n"
      "                          [--driver-us 0] [--sync-us 0] [--warmup-steps 0]\n"
      "                          [--rotor-slots 500] [--rotor-max-stages 400] [--json [--timeline]] [--plot FILE.svg]\n"
      "                          [--smoke]\n"
      "  --trace       op traces (.optrace, .optrace.gz) or synthetic ones: synth:mlp,\n"
      "                synth:transformer:layers=2 (models: mlp, transformer, resnet, unet; options\n"
      "                layers, batch, width, shared, seed). Default: every op trace in\n"
      "                " SPILLWAY_OP_TRACES_DIR "\n"
      "  --budgets     budget ratios: budget = ratio x the unconstrained peak reserved bytes\n"
      "  --policies    eviction policies (default: all); --modes engine modes (default: all three):\n"
      "                drop (recompute only, like DTR), hybrid (spill or drop by cost), spill (no lineage)\n"
      "  --verify      kernels write and check signatures: wrong bytes after a restore are counted\n"
      "  --expandable  expandable segments (VMM) on the simulated device\n"
      "  --max-split-mb  PyTorch's max_split_size_mb: cached blocks of at least this many MiB are not\n"
      "                split nor used for much smaller requests (fixed segments; 0: no limit)\n"
      "  --no-eager-drop  keep released buffers that lineage still needs resident until evicted\n"
      "  --no-compact   never move buffers to empty a segment before evicting (Note [Compaction])\n"
      "  --oom-layout  print the segments and their blocks to stderr when a run runs out of memory\n"
      "  --link-gbps   host<->device copy bandwidth each way (GB/s)\n"
      "  --max-recompute-factor  a pin that recomputes over this many times the lineage's whole cost\n"
      "                is thrashing and fails with out_of_memory (engine_config; 0: no bound)\n"
      "  --driver-us   simulated time per segment reserve or release and per page map or unmap call\n"
      "  --sync-us     simulated time per device synchronisation, beyond draining the streams\n"
      "  --warmup-steps  replay the trace this many times first, each a step (begin_step): the engine\n"
      "                predicts next uses from the last step's reads; the step after is measured\n"
      "  --json        machine-readable results on stdout; --plot: an SVG line plot per trace\n"
      "  --timeline    with --json: each run's memory and counters over the measured step (allocated,\n"
      "                reserved and resident bytes, spills, drops, restores, recomputes; after every\n"
      "                op, or every window of ops from 2,000 ops), for plot_results.py\n"
      "  --smoke       tiny synthetic traces with checks (for ctest)\n"
      "  Decision time (dec med / dec mean) is host wall time to choose one victim: the policy's\n"
      "  choose() including the engine's description of every candidate it samples. The upkeep that\n"
      "  keeps the candidates' cached costs current at drops and recomputes is reported apart\n"
      "  (--json: upkeep_steps, upkeep_mean_ns).\n",
      stdout);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// synth specs contain commas ("synth:mlp:layers=4,batch=64"): a new item starts at a comma that
// is followed by "synth:" or by something that is not key=value.
std::vector<std::string> split_traces(const std::string& s) {
  std::vector<std::string> out;
  for (const std::string& part : split_commas(s)) {
    const bool option = part.find('=') != std::string::npos && part.find(':') == std::string::npos;
    if (option && !out.empty() && out.back().rfind("synth:", 0) == 0) {
      out.back() += "," + part;
    } else {
      out.push_back(part);
    }
  }
  return out;
}

std::vector<std::string> default_traces() {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path dir = SPILLWAY_OP_TRACES_DIR;
  if (!dir.empty() && fs::is_directory(dir, ec)) {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.ends_with(".optrace") || n.ends_with(".optrace.gz")) out.push_back(e.path().string());
    }
  }
  std::sort(out.begin(), out.end());
  if (out.empty()) throw spillway::invalid_argument("no --trace given and no *.optrace in \"" + dir.string() + "\"");
  return out;
}

struct options {
  std::vector<double> ratios;
  std::vector<std::string> policies;
  std::vector<engine_mode> modes;
  run_config base;
  std::size_t rotor_slots = 500;
  std::size_t rotor_max_stages = 400;
  bool quiet = false;
};

op_trace::trace_data load(const std::string& name) {
  if (name.rfind("synth:", 0) == 0) return op_trace::synthesize(op_trace::parse_synth_spec(name.substr(6)));
  return op_trace::read_op_trace(name);
}

trace_report evaluate(const std::string& name, const op_trace::trace_data& t, const options& o) {
  trace_report r;
  r.name = name;
  r.trace = &t;
  r.summary = op_trace::summarize(t);
  r.ratios = o.ratios;
  const op_trace::liveness live = op_trace::compute_liveness(t);
  run_config base = o.base;
  base.mode = engine_mode::none;
  base.budget = unlimited_budget;
  run_with_large_stack([&] { r.baseline = replay(t, live, base); });
  if (!r.baseline.ok) throw std::runtime_error(name + ": the replay without a budget failed: " + r.baseline.failure);

  r.rotor.chain = extract_chain(t, live, cut_rule::every_cut);
  r.rotor.saved_chain = extract_chain(t, live, cut_rule::saved_cuts);
  std::vector<const chain_model*> models;
  for (const chain_model* c : {&r.rotor.chain, &r.rotor.saved_chain}) {
    if (c->ok && c->chain.stages.size() <= o.rotor_max_stages) models.push_back(c);
  }
  if (!r.rotor.chain.ok) {
    r.rotor.why = r.rotor.chain.why;
  } else if (models.empty()) {
    r.rotor.why = std::to_string(r.rotor.chain.chain.stages.size()) + " stages, over --rotor-max-stages";
  } else {
    r.rotor.computed = true;
    r.rotor.min_budget = best_rotor_min_device_budget(models);
    for (double ratio : o.ratios) {
      r.rotor.at.push_back(best_rotor_at(models, static_cast<std::size_t>(ratio * static_cast<double>(r.peak())), o.rotor_slots));
    }
  }

  for (const std::string& policy : o.policies) {
    for (engine_mode mode : o.modes) {
      series s;
      s.policy = policy;
      s.mode = mode;
      for (double ratio : o.ratios) {
        budget_point p;
        p.ratio = ratio;
        p.budget = static_cast<std::size_t>(ratio * static_cast<double>(r.peak()));
        run_config c = o.base;
        c.mode = mode;
        c.policy = policy;
        c.budget = p.budget;
        run_with_large_stack([&] { p.result = replay(t, live, c); });
        if (!o.quiet) {
          std::fprintf(stderr, "  %-28s %-16s %.2f  %s %.2f s\n", name.substr(0, 28).c_str(), s.label().c_str(), ratio,
                       p.result.ok ? "ok    " : "failed", p.result.wall_seconds);
        }
        s.points.push_back(std::move(p));
      }
      r.runs.push_back(std::move(s));
    }
  }
  return r;
}

std::string device_line(const options& o) {
  std::ostringstream s;
  s << "spillway-evict-sim on the simulated device (manual clock; copies " << o.base.link_bandwidth / 1e9
    << " GB/s each way, 2 us latency; " << (o.base.expandable ? "expandable segments" : "PyTorch's segment sizes")
    << (o.base.max_split_size == no_split_limit ? "" : ", max_split_size " + std::to_string(o.base.max_split_size >> 20) + " MiB")
    << "; driver calls " << static_cast<double>(o.base.driver_latency_ns) / 1000 << " us, device syncs "
    << static_cast<double>(o.base.sync_latency_ns) / 1000 << " us";
  if (o.base.warmup_steps > 0) {
    s << "; measured: step " << o.base.warmup_steps + 1 << ", next uses predicted from the step before";
  } else if (o.base.driver_latency_ns > 0 || o.base.sync_latency_ns > 0) {
    // From a cold allocator the step pays its first segment reserves, the baseline's included: the
    // overheads are then over a baseline that is more than the ops' time. --warmup-steps 1
    // measures a warmed step.
    s << "; measured: the first step, from a cold allocator whose first reserves the baseline pays "
         "too (--warmup-steps 1 for a warmed step)";
  }
  s << "); host " << std::thread::hardware_concurrency() << " cores; decision times are host wall time";
  return s.str();
}

// --- smoke --------------------------------------------------------------------------------------

// A run's timeline: a point as the step began and after every op (the smoke traces are short),
// in order, within the budget, its counters never going back and ending at the run's totals.
template <class Expect>
void check_timeline(const run_result& x, std::size_t budget, std::size_t ops, const std::string& at, Expect& expect) {
  const std::vector<timeline_sample>& tl = x.timeline;
  expect(tl.size() == ops + 1, at + ": a timeline point per op and one at the start");
  if (tl.empty()) return;
  bool ordered = true, within = true;
  for (std::size_t k = 0; k < tl.size(); ++k) {
    within = within && tl[k].reserved <= budget && tl[k].allocated <= tl[k].reserved;
    if (k == 0) continue;
    const timeline_sample &a = tl[k - 1], &b = tl[k];
    ordered = ordered && b.op == a.op + 1 && b.t_ns >= a.t_ns && b.spills >= a.spills && b.drops >= a.drops &&
              b.eager_drops >= a.eager_drops && b.restores >= a.restores && b.recomputes >= a.recomputes;
  }
  expect(ordered, at + ": timeline points in op order, time and counters never going back");
  expect(within, at + ": timeline within the budget, allocated within reserved");
  const timeline_sample& last = tl.back();
  expect(tl.front().op == 0 && last.op == ops && last.t_ns == x.total_ns, at + ": timeline spans the step");
  expect(last.spills == x.engine.spills && last.drops == x.pressure_drops() && last.eager_drops == x.eager_drops &&
             last.restores == x.engine.restores && last.recomputes == x.engine.recomputes,
         at + ": timeline ends at the run's counters");
}

int smoke(options o, bool json) {
  o.ratios = {1.0, 0.8, 0.6};
  o.modes = {engine_mode::drop_only, engine_mode::hybrid, engine_mode::spill_only};
  o.base.verify = true;
  o.base.timeline = true;
  o.quiet = true;
  const std::vector<std::string> specs = {"mlp:layers=8,batch=16384,width=256", "transformer:layers=1,batch=2",
                                          "resnet:layers=2,batch=4", "unet:layers=2,batch=1,width=8"};
  std::vector<op_trace::trace_data> traces;
  for (const std::string& spec : specs) {
    const op_trace::trace_data t = op_trace::synthesize(op_trace::parse_synth_spec(spec));
    traces.push_back(op_trace::parse_op_trace(op_trace::to_text(t), spec));  // through the text form
    if (!(traces.back() == t)) throw std::runtime_error("smoke: " + spec + " does not survive the text form");
  }
  std::vector<trace_report> reports;
  int failures = 0;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::fprintf(stderr, "spillway-evict-sim --smoke: FAILED: %s\n", what.c_str());
      ++failures;
    }
  };
  for (std::size_t i = 0; i < specs.size(); ++i) {
    reports.push_back(evaluate("synth:" + specs[i], traces[i], o));
    const trace_report& r = reports.back();
    expect(r.baseline.total_ns == r.summary.total_duration_ns, specs[i] + ": baseline time is the sum of op durations");
    for (const series& s : r.runs) {
      for (const budget_point& p : s.points) {
        const std::string at = specs[i] + " " + s.label() + " at " + std::to_string(p.ratio);
        expect(p.result.verify_mismatches == 0, at + ": every input read back its expected bytes");
        if (p.ratio == 1.0) expect(p.result.ok, at + ": runs at the unconstrained peak (" + p.result.failure + ")");
        if (p.result.ok && o.base.warmup_steps > 0) {
          expect(p.result.engine.steps == o.base.warmup_steps + 1, at + ": every step marked");
          expect(p.result.engine.next_use_mismatches == 0, at + ": the steps read as the one before");
        }
        if (p.result.ok) {
          expect(p.result.peak_reserved <= p.budget, at + ": peak reserved within the budget");
          expect(p.result.total_ns >= r.baseline.total_ns, at + ": no faster than the baseline");
          check_timeline(p.result, p.budget, traces[i].ops.size(), at, expect);
        }
      }
    }
  }
  const trace_report& mlp = reports.front();
  expect(mlp.rotor.computed && mlp.rotor.chain.chain.stages.size() == 9, "mlp: a 9-stage chain (8 layers + the loss)");
  bool recomputed = false;
  for (const series& s : mlp.runs) {
    if (s.mode == engine_mode::drop_only && s.points[1].result.ok) recomputed = recomputed || s.points[1].result.engine.recomputes > 0;
  }
  expect(recomputed, "mlp: a drop-only run recomputes at ratio 0.8");
  if (json) {
    bench::json_writer j(std::cout);
    j.begin_object().field("tool", "spillway-evict-sim").field("smoke", true).field("failures", failures);
    write_json(j, reports);
    j.end_object();
    std::cout << "\n";
  } else {
    print_table(std::cout, reports, device_line(o));
    std::printf("smoke: %s\n", failures ? "FAILED" : "ok");
  }
  return failures ? 1 : 0;
}

int run(int argc, char** argv) {
  bench::arg_parser args(argc, argv);
  if (args.flag("help")) {
    print_usage();
    return 0;
  }
  options o;
  const std::string traces_arg = args.get("trace", "");
  for (const std::string& s : split_commas(args.get("budgets", "1.0,0.8,0.6,0.5,0.4,0.3"))) {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (end == s.c_str() || *end != '\0' || !(v > 0) || v > 4) {
      throw spillway::invalid_argument("--budgets: \"" + s + "\" is not a ratio in (0, 4]");
    }
    o.ratios.push_back(v);
  }
  const std::string policies = args.get("policies", "");
  o.policies = policies.empty() ? eviction::policy_names() : split_commas(policies);
  for (const std::string& p : o.policies) (void)eviction::make_policy(p);  // names it if unknown
  for (const std::string& m : split_commas(args.get("modes", "drop,hybrid,spill"))) o.modes.push_back(parse_mode(m));
  o.base.verify = args.flag("verify");
  o.base.expandable = args.flag("expandable");
  o.base.eager_drop = !args.flag("no-eager-drop");
  o.base.compact = !args.flag("no-compact");
  if (const long long mib = args.get_int("max-split-mb", 0); mib != 0) {
    if (mib <= 20 || mib > (1ll << 28)) {
      throw spillway::invalid_argument("--max-split-mb " + std::to_string(mib) +
                                       ": expected MiB over 20 (PyTorch's max_split_size_mb), or 0 for none");
    }
    o.base.max_split_size = static_cast<std::size_t>(mib) << 20;
  }
  o.base.oom_layout = args.flag("oom-layout");
  const double link_gbps = args.get_double("link-gbps", 50);
  if (!(link_gbps > 0 && link_gbps <= 1e4)) {  // NaN fails too
    throw spillway::invalid_argument("--link-gbps " + std::to_string(link_gbps) +
                                     ": expected GB/s above 0, at most 10000");
  }
  o.base.link_bandwidth = link_gbps * 1e9;
  const double driver_us = args.get_double("driver-us", 0), sync_us = args.get_double("sync-us", 0);
  for (const auto& [name, us] : {std::pair{"--driver-us", driver_us}, std::pair{"--sync-us", sync_us}}) {
    if (!(us >= 0 && us <= 1e6)) {  // NaN fails too
      throw spillway::invalid_argument(std::string(name) + " " + std::to_string(us) +
                                       ": expected microseconds from 0 to 1000000");
    }
  }
  o.base.driver_latency_ns = static_cast<std::uint64_t>(driver_us * 1000);
  o.base.sync_latency_ns = static_cast<std::uint64_t>(sync_us * 1000);
  o.base.seed = static_cast<std::uint64_t>(args.get_int("seed", 1));
  o.base.max_recompute_factor = args.get_double("max-recompute-factor", o.base.max_recompute_factor);
  if (!(o.base.max_recompute_factor >= 0 && o.base.max_recompute_factor <= 1e9)) {  // NaN fails too
    throw spillway::invalid_argument("--max-recompute-factor " + std::to_string(o.base.max_recompute_factor) +
                                     ": expected a number from 0 (no bound) to 1e9");
  }
  const long long warmup = args.get_int("warmup-steps", 0);
  if (warmup < 0 || warmup > 100) {
    throw spillway::invalid_argument("--warmup-steps " + std::to_string(warmup) + ": expected 0 to 100");
  }
  o.base.warmup_steps = static_cast<std::size_t>(warmup);
  o.rotor_slots = static_cast<std::size_t>(args.get_int("rotor-slots", 500));
  o.rotor_max_stages = static_cast<std::size_t>(args.get_int("rotor-max-stages", 400));
  const bool json = args.flag("json");
  o.base.timeline = args.flag("timeline");
  if (o.base.timeline && !json) {
    throw spillway::invalid_argument("--timeline without --json: expected --json too (the timeline is written only there)");
  }
  const std::string plot = args.get("plot", "");
  const bool is_smoke = args.flag("smoke");
  o.quiet = args.flag("quiet");
  args.finish();
  if (is_smoke) return smoke(o, json);

  const std::vector<std::string> names = traces_arg.empty() ? default_traces() : split_traces(traces_arg);
  std::vector<op_trace::trace_data> traces;
  traces.reserve(names.size());
  for (const std::string& n : names) traces.push_back(load(n));
  std::vector<trace_report> reports;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!o.quiet) std::fprintf(stderr, "%s\n", names[i].c_str());
    reports.push_back(evaluate(names[i], traces[i], o));
  }
  bool corrupt = false, errors = false;
  for (const trace_report& r : reports) {
    for (const series& s : r.runs) {
      for (const budget_point& p : s.points) {
        corrupt = corrupt || p.result.verify_mismatches > 0;
        errors = errors || (!p.result.ok && !p.result.out_of_memory);
      }
    }
  }
  if (!plot.empty()) write_svg(plot, reports);
  if (json) {
    bench::json_writer j(std::cout);
    j.begin_object().field("tool", "spillway-evict-sim").field("device", device_line(o));
    j.field("verify", o.base.verify).field("expandable", o.base.expandable).field("eager_drop", o.base.eager_drop);
    j.field("compact", o.base.compact);
    j.field("max_split_mb", o.base.max_split_size == no_split_limit ? 0 : o.base.max_split_size >> 20);
    j.field("warmup_steps", static_cast<std::uint64_t>(o.base.warmup_steps));
    j.field("max_recompute_factor", o.base.max_recompute_factor);
    write_json(j, reports);
    j.end_object();
    std::cout << "\n";
  } else {
    print_table(std::cout, reports, device_line(o));
    if (!plot.empty()) std::printf("plot: %s\n", plot.c_str());
  }
  if (corrupt) std::fprintf(stderr, "spillway-evict-sim: a replay read back wrong bytes (see CORRUPT)\n");
  // Out of memory is a budget's outcome; any other failure is a bug of the engine or the replay.
  if (errors) std::fprintf(stderr, "spillway-evict-sim: a run failed with an error, not out of memory (see ERROR)\n");
  return corrupt || errors ? 1 : 0;
}

}  // namespace
}  // namespace spillway::evsim

int main(int argc, char** argv) { return spillway::bench::run_tool("spillway-evict-sim", spillway::evsim::run, argc, argv); }
