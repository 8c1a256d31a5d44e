// evict_sim_report: the table, the JSON and the SVG plot of spillway-evict-sim.
#include "evict_sim_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <ostream>

#include "spillway/errors.hpp"

namespace spillway::evsim {
namespace {

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string mib(double bytes) { return fmt("%.0f", bytes / (1 << 20)); }

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '<') o += "&lt;";
    else if (ch == '>') o += "&gt;";
    else if (ch == '&') o += "&amp;";
    else o += ch;
  }
  return o;
}

// A run's timeline as plot_results.py reads train_bench's: field names, then one array per point.
void write_timeline(bench::json_writer& j, const std::vector<timeline_sample>& tl) {
  j.key("timeline").begin_object();
  j.key("fields").begin_array();
  for (const char* f : {"op", "t_ms", "allocated", "reserved", "resident", "spills", "drops", "eager_drops",
                        "restores", "recomputes"}) {
    j.value(f);
  }
  j.end_array();
  j.key("samples").begin_array();
  for (const timeline_sample& p : tl) {
    j.begin_array().value(static_cast<std::uint64_t>(p.op)).value(static_cast<double>(p.t_ns) / 1e6);
    j.value(p.allocated).value(p.reserved).value(p.resident);
    j.value(p.spills).value(p.drops).value(p.eager_drops).value(p.restores).value(p.recomputes).end_array();
  }
  j.end_array();
  j.end_object();
}

}  // namespace

double trace_report::overhead(const run_result& r) const {
  return baseline.total_ns ? static_cast<double>(r.total_ns) / static_cast<double>(baseline.total_ns) - 1 : 0;
}

double trace_report::stall_ns(const run_result& r) const {
  return static_cast<double>(r.total_ns) - static_cast<double>(baseline.total_ns) - r.engine.recompute_cost_ns;
}

std::vector<chain_target> chain_targets(const trace_report& r, double limit) {
  std::vector<chain_target> out;
  const bool any_drop_only = std::any_of(r.runs.begin(), r.runs.end(), [](const series& s) {
    return s.mode == engine_mode::drop_only;
  });
  if (!r.rotor.computed || !any_drop_only) return out;  // nothing to hold to rotor's optimum
  for (std::size_t i = 0; i < r.ratios.size(); ++i) {
    const rotor_point& rp = r.rotor.at[i];
    if (!rp.feasible) continue;  // below rotor's minimum: no target
    chain_target t;
    t.ratio = r.ratios[i];
    t.rotor_feasible = true;
    t.rotor_extra_ns = rp.extra_cost_ns;
    t.rotor_bound_ns = rp.lower_bound_extra_ns;
    t.rotor_fallback = rp.least_memory_fallback;
    t.best_added_ns = std::numeric_limits<double>::infinity();
    for (const series& s : r.runs) {
      const run_result& x = s.points[i].result;
      // A corrupt run (a verified read came back wrong) counts as none.
      if (s.mode != engine_mode::drop_only || std::string(x.status()) != "ok") continue;
      // Everything the run added to the baseline's time: its recomputes, and the stalls of the
      // moves compaction made to avoid them (rotor's schedule has no such time).
      const double e = static_cast<double>(x.total_ns) - static_cast<double>(r.baseline.total_ns);
      if (e < t.best_added_ns) {
        t.best_added_ns = e;
        t.best = s.label();
      }
    }
    const auto factor_of = [&](double rotor_ns) {
      if (t.best.empty()) return std::numeric_limits<double>::infinity();
      if (rotor_ns <= 0) return t.best_added_ns <= 0 ? 1.0 : std::numeric_limits<double>::infinity();
      return t.best_added_ns / rotor_ns;
    };
    t.factor = factor_of(t.rotor_extra_ns);
    t.factor_vs_bound = factor_of(t.rotor_bound_ns);
    t.met = (t.rotor_fallback ? t.factor_vs_bound : t.factor) <= limit;
    t.judged = r.rotor.chain.backward_param_bytes == 0 && r.rotor.saved_chain.backward_param_bytes == 0;
    out.push_back(t);
  }
  return out;
}

// --- table -------------------------------------------------------------------------------------

void print_table(std::ostream& out, const std::vector<trace_report>& reports, const std::string& device_line) {
  char line[512];
  out << device_line << "\n";
  for (const trace_report& r : reports) {
    const op_trace::trace_summary& s = r.summary;
    std::snprintf(line, sizeof line,
                  "\n== %s: %zu ops (%zu forward), %zu buffers, params %s MiB; peak %s MiB reserved "
                  "(%s MiB live); baseline %.3f ms\n",
                  r.name.c_str(), s.ops, s.forward_ops, s.buffers, mib(static_cast<double>(s.param_bytes)).c_str(),
                  mib(static_cast<double>(r.peak())).c_str(), mib(static_cast<double>(s.peak_live_bytes)).c_str(),
                  static_cast<double>(r.baseline.total_ns) / 1e6);
    out << line;
    if (r.rotor.computed) {
      std::snprintf(line, sizeof line,
                    "   rotor: %zu stages (%zu at saved buffers only; the better plan counts), fixed %s MiB, "
                    "minimum budget %s MiB = ratio %.3f%s\n",
                    r.rotor.chain.chain.stages.size(), r.rotor.saved_chain.chain.stages.size(),
                    mib(static_cast<double>(r.rotor.chain.fixed_bytes)).c_str(),
                    mib(static_cast<double>(r.rotor.min_budget)).c_str(),
                    static_cast<double>(r.rotor.min_budget) / static_cast<double>(r.peak()),
                    r.rotor.chain.backward_param_bytes == 0
                        ? ""
                        : ("\n   (rotor leaves out the " + mib(static_cast<double>(r.rotor.chain.backward_param_bytes)) +
                           " MiB of gradients the backward makes: a lower bound, not judged as a target)")
                              .c_str());
    } else {
      std::snprintf(line, sizeof line, "   rotor: not computed (%s)\n", r.rotor.why.c_str());
    }
    out << line;
    std::snprintf(line, sizeof line, "%-18s %5s %7s %8s %9s %8s %9s %7s %9s %8s %8s %6s %6s %6s %8s %8s %6s\n",
                  "policy/mode", "ratio", "budget", "status", "time ms", "overhd", "extra ms", "x rotor",
                  "stall ms", "spill MB", "rest. MB", "evict", "drops", "spills", "dec med", "dec mean", "cand");
    out << line;
    for (std::size_t i = 0; i < r.ratios.size(); ++i) {
      if (r.rotor.computed && r.rotor.at[i].feasible) {
        const rotor_point& p = r.rotor.at[i];
        std::snprintf(line, sizeof line, "%-18s %5.2f %7s %8s %9.3f %7.1f%% %9.3f %7s\n", "rotor (optimum)",
                      r.ratios[i], mib(static_cast<double>(r.ratios[i] * static_cast<double>(r.peak()))).c_str(),
                      p.least_memory_fallback ? "fallback" : "ok",
                      (static_cast<double>(r.baseline.total_ns) + p.extra_cost_ns) / 1e6,
                      100 * p.extra_cost_ns / static_cast<double>(r.baseline.total_ns), p.extra_cost_ns / 1e6, "1.00");
        out << line;
      }
      for (const series& sr : r.runs) {
        const budget_point& bp = sr.points[i];
        const run_result& x = bp.result;
        if (!x.ok) {
          std::snprintf(line, sizeof line, "%-18s %5.2f %7s %8s  %s\n", sr.label().c_str(), bp.ratio,
                        mib(static_cast<double>(bp.budget)).c_str(), x.out_of_memory ? "OOM" : "ERROR",
                        x.failure.substr(0, 90).c_str());
          out << line;
          continue;
        }
        std::string vs_rotor = "-";
        if (r.rotor.computed && r.rotor.at[i].feasible && r.rotor.at[i].extra_cost_ns > 0) {
          vs_rotor = fmt("%.2f", x.engine.recompute_cost_ns / r.rotor.at[i].extra_cost_ns);
        }
        std::snprintf(line, sizeof line,
                      "%-18s %5.2f %7s %8s %9.3f %7.1f%% %9.3f %7s %9.3f %8s %8s %6llu %6llu %6llu %8.2f %8.2f %6zu\n",
                      sr.label().c_str(), bp.ratio, mib(static_cast<double>(bp.budget)).c_str(),
                      x.verify_mismatches ? "CORRUPT" : "ok", static_cast<double>(x.total_ns) / 1e6,
                      100 * r.overhead(x), x.engine.recompute_cost_ns / 1e6, vs_rotor.c_str(), r.stall_ns(x) / 1e6,
                      mib(static_cast<double>(x.engine.bytes_spilled)).c_str(),
                      mib(static_cast<double>(x.engine.bytes_restored)).c_str(),
                      static_cast<unsigned long long>(x.pressure_evictions()),
                      static_cast<unsigned long long>(x.pressure_drops()),
                      static_cast<unsigned long long>(x.engine.spills), x.decision_median_ns() / 1e3,
                      x.decision_mean_ns() / 1e3, x.max_candidates);
        out << line;
      }
    }
    const auto targets = chain_targets(r);
    if (!targets.empty()) {
      out << "   chain target (best drop-only time added to the baseline, recomputes and stalls, <= 1.15 x\n"
             "   rotor's extra compute, at budgets >= rotor's minimum; bound: rotor with sizes rounded down,\n"
             "   which no persistent schedule beats):\n";
      const auto x = [](double f) { return std::isfinite(f) ? fmt("%.3fx", f) : std::string("inf"); };
      for (const chain_target& t : targets) {
        std::snprintf(line, sizeof line,
                      "     ratio %.2f: rotor %.3f ms%s (bound %.3f), best %s %.3f ms -> %s (%s the bound)  %s\n",
                      t.ratio, t.rotor_extra_ns / 1e6, t.rotor_fallback ? " [fallback plan]" : "",
                      t.rotor_bound_ns / 1e6, t.best.empty() ? "(no drop-only run finished)" : t.best.c_str(),
                      t.best_added_ns / 1e6, x(t.factor).c_str(), x(t.factor_vs_bound).c_str(),
                      !t.judged ? "not judged" : t.met ? "met" : "MISSED");
        out << line;
      }
    }
  }
  out << "overhd = time / baseline - 1; extra = recompute kernels; stall = time - baseline - extra (copies,\n"
         "and the driver calls and device syncs that --driver-us / --sync-us charge; counts in the JSON);\n"
         "evict/drops exclude drops at release (DTR's eager eviction); dec med/mean = us of host wall time to\n"
         "choose one victim: the policy's choose() with the engine describing the candidates it samples\n"
         "(median of per-op means / mean; the upkeep of their cached costs at drops and recomputes is in\n"
         "the JSON, upkeep_mean_ns); cand = most evictable resident buffers sampled\n";
}

// --- JSON --------------------------------------------------------------------------------------

void write_json(bench::json_writer& j, const std::vector<trace_report>& reports) {
  j.key("traces").begin_array();
  for (const trace_report& r : reports) {
    j.begin_object();
    j.field("name", r.name);
    j.field("model", r.trace->model).field("source", r.trace->source);
    j.field("ops", static_cast<std::uint64_t>(r.summary.ops)).field("buffers", static_cast<std::uint64_t>(r.summary.buffers));
    j.field("param_bytes", r.summary.param_bytes).field("peak_live_bytes", r.summary.peak_live_bytes);
    j.field("peak_reserved", static_cast<std::uint64_t>(r.peak()));
    j.field("baseline_ns", r.baseline.total_ns);
    j.key("rotor").begin_object();
    j.field("computed", r.rotor.computed);
    if (r.rotor.computed) {
      j.field("stages", static_cast<std::uint64_t>(r.rotor.chain.chain.stages.size()));
      j.field("saved_cut_stages", static_cast<std::uint64_t>(r.rotor.saved_chain.chain.stages.size()));
      j.field("fixed_bytes", static_cast<std::uint64_t>(r.rotor.chain.fixed_bytes));
      j.field("backward_param_bytes", static_cast<std::uint64_t>(r.rotor.chain.backward_param_bytes));
      j.field("min_budget", static_cast<std::uint64_t>(r.rotor.min_budget));
      j.field("min_ratio", static_cast<double>(r.rotor.min_budget) / static_cast<double>(r.peak()));
      j.key("points").begin_array();
      for (std::size_t i = 0; i < r.ratios.size(); ++i) {
        const rotor_point& p = r.rotor.at[i];
        j.begin_object().field("ratio", r.ratios[i]).field("feasible", p.feasible);
        j.field("plan_seconds", p.plan_seconds);
        if (p.feasible) {
          j.field("extra_ns", p.extra_cost_ns).field("overhead", p.extra_cost_ns / static_cast<double>(r.baseline.total_ns));
          j.field("peak_bytes", static_cast<std::uint64_t>(p.peak_bytes)).field("least_memory_fallback", p.least_memory_fallback);
          j.field("lower_bound_extra_ns", p.lower_bound_extra_ns);
          j.field("stages", static_cast<std::uint64_t>(p.stages));
        }
        j.end_object();
      }
      j.end_array();
    } else {
      j.field("why", r.rotor.why);
    }
    j.end_object();
    j.key("runs").begin_array();
    for (const series& s : r.runs) {
      for (const budget_point& bp : s.points) {
        const run_result& x = bp.result;
        j.begin_object();
        j.field("policy", s.policy).field("mode", to_string(s.mode)).field("ratio", bp.ratio);
        j.field("budget", static_cast<std::uint64_t>(bp.budget)).field("ok", x.ok).field("status", x.status());
        if (!x.ok) j.field("failure", x.failure);
        j.field("ops_done", static_cast<std::uint64_t>(x.ops_done));
        // A run that did not finish has no time, overhead or stall: null, never a number that
        // reads as a result (0% overhead).
        constexpr double none = std::numeric_limits<double>::quiet_NaN();
        j.field("time_ns", x.ok ? static_cast<double>(x.total_ns) : none)
            .field("overhead", x.ok ? r.overhead(x) : none);
        j.field("extra_compute_ns", x.engine.recompute_cost_ns).field("stall_ns", x.ok ? r.stall_ns(x) : none);
        j.field("peak_reserved", static_cast<std::uint64_t>(x.peak_reserved));
        j.field("bytes_spilled", x.engine.bytes_spilled).field("bytes_restored", x.engine.bytes_restored);
        j.field("bytes_recomputed", x.engine.bytes_recomputed);
        j.field("moves", x.engine.moves).field("bytes_moved", x.engine.bytes_moved);
        j.field("segments_emptied", x.engine.segments_emptied);
        j.field("evictions", x.pressure_evictions()).field("drops", x.pressure_drops()).field("spills", x.engine.spills);
        j.field("eager_drops", x.eager_drops).field("recomputes", x.engine.recomputes).field("restores", x.engine.restores);
        j.field("steps", x.engine.steps).field("next_use_mismatches", x.engine.next_use_mismatches);
        j.field("decisions", x.engine.decisions);
        j.field("decision_median_ns", x.decision_median_ns()).field("decision_mean_ns", x.decision_mean_ns());
        j.field("upkeep_steps", x.engine.upkeep_steps);
        j.field("upkeep_mean_ns", x.engine.upkeep_steps ? x.engine.upkeep_time_ns / static_cast<double>(x.engine.upkeep_steps) : 0.0);
        j.field("max_candidates", static_cast<std::uint64_t>(x.max_candidates));
        j.field("device_syncs", x.device_syncs).field("device_allocs", x.device_allocs);
        j.field("device_frees", x.device_frees).field("releases_before_eviction", x.releases_before_eviction);
        j.field("verify_checks", x.verify_checks).field("verify_mismatches", x.verify_mismatches);
        j.field("wall_seconds", x.wall_seconds);
        if (!x.timeline.empty()) write_timeline(j, x.timeline);
        j.end_object();
      }
    }
    j.end_array();
    const auto targets = chain_targets(r);
    j.key("chain_targets").begin_array();
    for (const chain_target& t : targets) {
      j.begin_object().field("ratio", t.ratio).field("rotor_extra_ns", t.rotor_extra_ns).field("best", t.best);
      j.field("rotor_bound_extra_ns", t.rotor_bound_ns).field("rotor_fallback", t.rotor_fallback);
      j.field("best_added_ns", std::isfinite(t.best_added_ns) ? t.best_added_ns : -1.0);
      j.field("factor", std::isfinite(t.factor) ? t.factor : -1.0);
      j.field("factor_vs_bound", std::isfinite(t.factor_vs_bound) ? t.factor_vs_bound : -1.0);
      j.field("met", t.met).field("judged", t.judged).end_object();
    }
    j.end_array();
    j.end_object();
  }
  j.end_array();
}

// --- SVG ---------------------------------------------------------------------------------------

void write_svg(const std::string& path, const std::vector<trace_report>& reports) {
  static const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                                 "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"};
  const double w = 900, h = 380, left = 70, right = 220, top = 40, bottom = 50;
  const double pw = w - left - right, ph = h - top - bottom;
  std::string svg;
  char b[512];
  std::snprintf(b, sizeof b,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
                "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                w, h * static_cast<double>(reports.size()));
  svg += b;
  for (std::size_t ri = 0; ri < reports.size(); ++ri) {
    const trace_report& r = reports[ri];
    const double y0 = h * static_cast<double>(ri);
    double xmin = 1, xmax = 0, ymax = 0.05;
    for (double x : r.ratios) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
    }
    if (xmax <= xmin) xmax = xmin + 0.1;
    for (const series& s : r.runs) {
      for (const budget_point& p : s.points) {
        if (p.result.ok) ymax = std::max(ymax, r.overhead(p.result));
      }
    }
    if (r.rotor.computed) {
      for (const rotor_point& p : r.rotor.at) {
        if (p.feasible) ymax = std::max(ymax, p.extra_cost_ns / static_cast<double>(r.baseline.total_ns));
      }
    }
    ymax = std::min(ymax * 1.08, 3.0);  // overheads past 300% are clipped
    const auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * pw; };
    const auto py = [&](double y) { return y0 + top + ph - std::min(y, ymax) / ymax * ph; };
    std::snprintf(b, sizeof b, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"14\" font-weight=\"bold\">%s</text>\n", left,
                  y0 + 22, xml_escape(r.name).c_str());
    svg += b;
    std::snprintf(b, sizeof b, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n",
                  left, y0 + top, pw, ph);
    svg += b;
    for (int i = 0; i <= 5; ++i) {
      const double yv = ymax * i / 5;
      std::snprintf(b, sizeof b,
                    "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%.1f\" y=\"%.1f\" "
                    "text-anchor=\"end\">%.0f%%</text>\n",
                    left, left + pw, py(yv), py(yv), left - 6, py(yv) + 4, 100 * yv);
      svg += b;
    }
    for (double x : r.ratios) {
      std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.2f</text>\n", px(x),
                    y0 + top + ph + 16, x);
      svg += b;
    }
    std::snprintf(b, sizeof b,
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">budget / unconstrained peak reserved</text>\n"
                  "<text transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">time overhead</text>\n",
                  left + pw / 2, y0 + h - 12, 18.0, y0 + top + ph / 2);
    svg += b;
    // Lines: rotor first (dashed black), then each series; failed points break the line.
    struct line_def {
      std::string label, color, dash;
      std::vector<std::pair<double, double>> pts;  // NaN y: a gap
    };
    std::vector<line_def> lines;
    if (r.rotor.computed) {
      line_def l{"rotor optimum", "#000", "6,4", {}};
      for (std::size_t i = 0; i < r.ratios.size(); ++i) {
        const rotor_point& p = r.rotor.at[i];
        l.pts.emplace_back(r.ratios[i], p.feasible ? p.extra_cost_ns / static_cast<double>(r.baseline.total_ns) : NAN);
      }
      lines.push_back(l);
    }
    for (std::size_t si = 0; si < r.runs.size(); ++si) {
      const series& s = r.runs[si];
      line_def l{s.label(), colors[si % 12], s.mode == engine_mode::drop_only ? "" : s.mode == engine_mode::hybrid ? "2,2" : "8,3,2,3", {}};
      for (const budget_point& p : s.points) l.pts.emplace_back(p.ratio, p.result.ok ? r.overhead(p.result) : NAN);
      lines.push_back(l);
    }
    for (std::size_t li = 0; li < lines.size(); ++li) {
      const line_def& l = lines[li];
      std::vector<std::pair<double, double>> pts = l.pts;
      std::sort(pts.begin(), pts.end(), [](const auto& a, const auto& c) { return a.first < c.first; });
      std::string poly;
      const auto flush = [&] {
        if (!poly.empty()) {
          svg += "<polyline fill=\"none\" stroke=\"" + l.color + "\" stroke-width=\"1.8\"" +
                 (l.dash.empty() ? "" : " stroke-dasharray=\"" + l.dash + "\"") + " points=\"" + poly + "\"/>\n";
        }
        poly.clear();
      };
      for (const auto& [x, y] : pts) {
        if (std::isnan(y)) {
          flush();
          continue;
        }
        std::snprintf(b, sizeof b, "%.1f,%.1f ", px(x), py(y));
        poly += b;
        std::snprintf(b, sizeof b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", px(x), py(y), l.color.c_str());
        svg += b;
      }
      flush();
      const double ly = y0 + top + 6 + 15 * static_cast<double>(li);
      std::snprintf(b, sizeof b,
                    "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>"
                    "<text x=\"%.0f\" y=\"%.1f\">%s</text>\n",
                    left + pw + 12, left + pw + 36, ly, ly, l.color.c_str(),
                    l.dash.empty() ? "" : (" stroke-dasharray=\"" + l.dash + "\"").c_str(), left + pw + 42, ly + 4,
                    xml_escape(l.label).c_str());
      svg += b;
    }
  }
  svg += "</svg>\n";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << svg;
  out.close();
  if (!out) throw spillway::invalid_argument("cannot write the plot \"" + path + "\"");
}

}  // namespace spillway::evsim
