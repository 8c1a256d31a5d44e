#!/usr/bin/env python3
"""plot_results: SVG plots of spillway's benchmark results, with no dependency beyond Python 3.

    python3 bench/plot_results.py --sim bench/results/sim-2026-11-21/plots/*.json \\
                                  --out bench/results/sim-2026-11-21/plots
    python3 bench/plot_results.py --train out/train_bench.json --out out/plots

Contract
- Inputs: --sim FILE... (spillway-evict-sim --json output) and --train FILE... (train_bench.py
  --json documents). Each is read whole; a file that is not such a document is an error naming it.
- From simulator JSON, per trace:
    sim-overhead-<trace>.svg   overhead (time / baseline - 1) against the budget ratio, one line
                               per policy/mode (colour: policy; dash: mode, as spillway-evict-sim
                               --plot draws them), rotor's optimum dashed black; failed runs (out of
                               memory) are an x on the top edge at their ratio, overheads past --ymax
                               a triangle there
    sim-cost-<trace>.svg       where the time goes: for the best run of each mode at each ratio,
                               recompute (extra compute) and stall (waiting for copies) stacked, as
                               a share of the baseline
    sim-memory-<trace>.svg     the budget, the peak reserved bytes of the best run of each mode, the
                               unconstrained peak, live peak and parameters, with each run's
                               evictions written next to its point (per-run peaks)
    sim-timeline-<trace>-<policy>-<mode>-<ratio>.svg
                               per run with a timeline (spillway-evict-sim --json --timeline):
                               allocated, reserved and the engine's resident bytes over the
                               measured step in simulated time, the budget, and ticks where spills,
                               drops, restores and recomputes happened (a run out of memory: up to
                               the last point before the op that failed)
  and sim-overview.svg: the best run per mode and rotor for every trace, one panel each.
- From train_bench JSON, per model: train-<model>.svg: step-time overhead against the unconstrained
  run and peak reserved / the unconstrained peak, against the budget ratio, one line per
  configuration (a run that did not finish: x on the top edge). Per result with a timeline
  (train_bench --timeline):
  timeline-<model>-<config>-<ratio>.svg: allocated and reserved bytes (GPU) or resident saved
  activations (CPU) over one step, the budget, and ticks where spills, drops, restores and
  recomputes happened. The plot's subtitle names the device; a CPU run is labelled a harness
  check, not a measurement.
- Every plot carries --label (default for simulator plots: "simulated device, 2-core dev
  machine"), the input file and, where the document has one, its commit.
- --markdown FILE: also writes, per simulator trace, a table of the best overhead per mode (with
  its policy) and rotor's at each ratio: the numbers the plots show, for docs/results.md.
- Prints the files written, one a line. Exit 2 for bad arguments, 1 for an unreadable input.
"""

import argparse
import glob
import html
import json
import math
import os
import re
import sys

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf", "#393b79", "#637939"]
MODE_DASH = {"drop": "", "hybrid": "2,2", "spill": "8,3,2,3"}
MODE_COLOR = {"drop": "#1f77b4", "hybrid": "#2ca02c", "spill": "#ff7f0e"}
SIM_LABEL = "simulated device, 2-core dev machine"
MiB = float(1 << 20)


# ================================================================================================
# A small SVG writer
# ================================================================================================

def esc(text):
    return html.escape(str(text), quote=True)


class SVG:
    def __init__(self, width, height):
        self.width, self.height = width, height
        self.parts = ['<rect width="100%" height="100%" fill="white"/>']

    def add(self, element):
        self.parts.append(element)

    def text(self, x, y, s, size=12, anchor="start", weight=None, color=None, rotate=None):
        attrs = f'x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"'
        if weight:
            attrs += f' font-weight="{weight}"'
        if color:
            attrs += f' fill="{color}"'
        if rotate is not None:
            attrs = (f'transform="translate({x:.1f} {y:.1f}) rotate({rotate})" font-size="{size}" '
                     f'text-anchor="{anchor}"')
        self.add(f"<text {attrs}>{esc(s)}</text>")

    def line(self, x1, y1, x2, y2, color="#444", width=1.0, dash=""):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
                 f'stroke-width="{width}"{d}/>')

    def rect(self, x, y, w, h, fill="none", stroke=None, opacity=None):
        s = f' stroke="{stroke}"' if stroke else ""
        o = f' fill-opacity="{opacity}"' if opacity is not None else ""
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" '
                 f'fill="{fill}"{s}{o}/>')

    def polyline(self, pts, color, width=1.8, dash=""):
        if len(pts) < 2:
            return
        d = f' stroke-dasharray="{dash}"' if dash else ""
        p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        self.add(f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{d} points="{p}"/>')

    def circle(self, x, y, r, color):
        self.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{color}"/>')

    def cross(self, x, y, r, color):
        self.line(x - r, y - r, x + r, y + r, color, 1.6)
        self.line(x - r, y + r, x + r, y - r, color, 1.6)

    def triangle(self, x, y, r, color):
        self.add(f'<polygon points="{x - r:.1f},{y + r:.1f} {x + r:.1f},{y + r:.1f} {x:.1f},{y - r:.1f}" '
                 f'fill="{color}"/>')

    def render(self):
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width:.0f}" height="{self.height:.0f}" '
                f'font-family="sans-serif" font-size="12">\n' + "\n".join(self.parts) + "\n</svg>\n")


def nice_step(span, ticks=5):
    raw = span / max(ticks, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


class Axes:
    """A plot area in an SVG with linear x and y scales, grid, ticks and labels."""

    def __init__(self, svg, x, y, w, h, xlim, ylim, xlabel="", ylabel="", title="", yfmt="{:.0f}",
                 xfmt="{:.2f}", xticks=None):
        self.svg, self.x, self.y, self.w, self.h = svg, x, y, w, h
        self.x0, self.x1 = xlim
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        self.y0, self.y1 = ylim
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1
        self.frame(xlabel, ylabel, title, yfmt, xfmt, xticks)

    def px(self, v):
        return self.x + (v - self.x0) / (self.x1 - self.x0) * self.w

    def py(self, v):
        v = min(max(v, self.y0), self.y1)
        return self.y + self.h - (v - self.y0) / (self.y1 - self.y0) * self.h

    def frame(self, xlabel, ylabel, title, yfmt, xfmt, xticks):
        s = self.svg
        step = nice_step(self.y1 - self.y0)
        v = math.ceil(self.y0 / step) * step
        while v <= self.y1 + 1e-9:
            s.line(self.x, self.py(v), self.x + self.w, self.py(v), "#ddd")
            s.text(self.x - 6, self.py(v) + 4, yfmt.format(v), anchor="end")
            v += step
        if xticks is None:
            xstep = nice_step(self.x1 - self.x0)
            xticks, v = [], math.ceil(self.x0 / xstep) * xstep
            while v <= self.x1 + 1e-9:
                xticks.append(v)
                v += xstep
        for v in xticks:
            s.text(self.px(v), self.y + self.h + 16, xfmt.format(v), anchor="middle")
        s.rect(self.x, self.y, self.w, self.h, stroke="#444")
        if title:
            s.text(self.x, self.y - 8, title, size=13, weight="bold")
        if xlabel:
            s.text(self.x + self.w / 2, self.y + self.h + 34, xlabel, anchor="middle")
        if ylabel:
            s.text(self.x - 48, self.y + self.h / 2, ylabel, anchor="middle", rotate=-90)

    def series(self, pts, color, dash="", clip_top=True, mark_failures=True):
        """pts: (x, y) with y None for a failed point (an x on the top edge unless mark_failures is
        off); y above the top: a triangle there. The line breaks at failures."""
        run = []
        for x, y in sorted(pts, key=lambda p: p[0]):
            if y is None:
                self.svg.polyline(run, color, dash=dash)
                run = []
                if mark_failures:
                    self.svg.cross(self.px(x), self.y + 6, 4, color)
                continue
            X, Y = self.px(x), self.py(y)
            run.append((X, Y))
            if clip_top and y > self.y1:
                self.svg.triangle(X, self.y + 5, 4, color)
            else:
                self.svg.circle(X, Y, 2.5, color)
        self.svg.polyline(run, color, dash=dash)

    def hline(self, v, color="#888", dash="4,3", label=None):
        self.svg.line(self.x, self.py(v), self.x + self.w, self.py(v), color, 1.2, dash)
        if label:
            self.svg.text(self.x + self.w - 4, self.py(v) - 4, label, size=10, anchor="end", color=color)


def legend(svg, x, y, entries, width=None):
    """entries: (label, color, dash) drawn as short lines with their label, one a row."""
    for i, (label, color, dash) in enumerate(entries):
        ly = y + 15 * i
        svg.line(x, ly, x + 24, ly, color, 2, dash)
        svg.text(x + 30, ly + 4, label)


def footer(svg, text):
    svg.text(10, svg.height - 8, text, size=10, color="#555")


def slug(text):
    base = os.path.basename(text)
    for ext in (".optrace.gz", ".optrace", ".json"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-") or "trace"


def write(svg, path, written):
    with open(path, "w") as f:
        f.write(svg.render())
    written.append(path)


# ================================================================================================
# Simulator JSON
# ================================================================================================

def load_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read it as {what}: {e}") from None


class InputError(Exception):
    pass


def sim_traces(path):
    d = load_json(path, "spillway-evict-sim --json output")
    if d.get("tool") != "spillway-evict-sim" or not isinstance(d.get("traces"), list):
        raise InputError(f"{path}: not spillway-evict-sim --json output (no tool/traces)")
    return d


def run_status(run):
    """ok, oom, error or corrupt: the JSON's status; older JSON without one, from its fields."""
    if "status" in run:
        return run["status"]
    if run.get("ok"):
        return "corrupt" if run.get("verify_mismatches", 0) else "ok"
    return "oom" if str(run.get("failure", "")).startswith("out of memory") else "error"


def good(run):
    return run_status(run) == "ok"


def missing_label(trace, mode, ratio):
    """What a mode's missing best run at `ratio` was: OOM when every run ran out of memory."""
    runs = [r for r in trace["runs"] if r["mode"] == mode and r["ratio"] == ratio]
    return "OOM" if runs and all(run_status(r) == "oom" for r in runs) else "failed"


def best_by_mode(trace):
    """{mode: {ratio: best ok run or None}}"""
    out = {}
    for r in trace["runs"]:
        slot = out.setdefault(r["mode"], {})
        cur = slot.get(r["ratio"])
        if good(r) and (cur is None or r["overhead"] < cur["overhead"]):
            slot[r["ratio"]] = r
        else:
            slot.setdefault(r["ratio"], None)
    return out


def ratios_of(trace):
    return sorted({r["ratio"] for r in trace["runs"]})


def rotor_points(trace):
    rotor = trace.get("rotor") or {}
    if not rotor.get("computed"):
        return None
    return [(p["ratio"], p["overhead"] if p.get("feasible") else None) for p in rotor.get("points", [])]


def trace_title(trace):
    return (f"{trace['name']}: peak {trace['peak_reserved'] / MiB:.0f} MiB reserved, "
            f"params {trace['param_bytes'] / MiB:.0f} MiB, baseline {trace['baseline_ns'] / 1e6:.1f} ms")


def plot_sim_overhead(trace, src, label, ymax, policies, modes, out, written):
    svg = SVG(960, 420)
    ratios = ratios_of(trace)
    series = {}
    for r in trace["runs"]:
        if (policies and r["policy"] not in policies) or (modes and r["mode"] not in modes):
            continue
        series.setdefault((r["policy"], r["mode"]), []).append((r["ratio"], r["overhead"] if good(r) else None))
    top = max([y for pts in series.values() for _, y in pts if y is not None] +
              [y for _, y in (rotor_points(trace) or []) if y is not None] + [0.05])
    top = min(top * 1.08, ymax)
    ax = Axes(svg, 70, 60, 600, 290, (min(ratios), max(ratios)), (0, top),
              "budget / unconstrained peak reserved", "time overhead", trace_title(trace),
              yfmt="{:.0%}", xticks=ratios)
    entries = []
    rp = rotor_points(trace)
    if rp:
        ax.series(rp, "#000", "6,4")
        entries.append(("rotor optimum", "#000", "6,4"))
    policy_color = {}
    for (policy, mode), pts in sorted(series.items()):
        color = policy_color.setdefault(policy, COLORS[len(policy_color) % len(COLORS)])
        ax.series(pts, color, MODE_DASH.get(mode, ""), mark_failures=False)
        entries.append((f"{policy}/{mode}", color, MODE_DASH.get(mode, "")))
    for ratio in ratios:  # one mark per ratio: how many of the runs failed there, and how
        failed = [r for r in trace["runs"] if r["ratio"] == ratio and not good(r)]
        if failed:
            oom = sum(1 for r in failed if run_status(r) == "oom")
            text = (f"{len(failed)}/{len(series)} OOM" if oom == len(failed)
                    else f"{len(failed)}/{len(series)} failed ({oom} OOM)")
            svg.cross(ax.px(ratio), ax.y + 6, 4, "#d62728")
            svg.text(ax.px(ratio) + (8 if ratio < max(ratios) else -8), ax.y + 20, text, size=10,
                     color="#d62728", anchor="start" if ratio < max(ratios) else "end")
    legend(svg, 700, 70, entries)
    notes = ["red x and 'n/m OOM': runs out of memory ('failed': an error or a wrong read too)",
             "black x: rotor infeasible",
             f"triangle: overhead above {ymax:.0%}"]
    for i, note in enumerate(notes):
        svg.text(700, 70 + 15 * len(entries) + 12 + 14 * i, note, size=10, color="#555")
    footer(svg, f"{label}; {src}")
    write(svg, os.path.join(out, f"sim-overhead-{slug(trace['name'])}.svg"), written)


def plot_sim_cost(trace, src, label, out, written):
    best = best_by_mode(trace)
    modes = [m for m in ("drop", "hybrid", "spill") if m in best]
    ratios = sorted(ratios_of(trace), reverse=True)
    base = trace["baseline_ns"]
    top = 0.05
    for m in modes:
        for r in best[m].values():
            if r:
                top = max(top, (r["extra_compute_ns"] + max(r["stall_ns"], 0)) / base)
    top *= 1.1
    svg = SVG(960, 420)
    ax = Axes(svg, 70, 60, 600, 290, (0, len(ratios)), (0, top), "budget / unconstrained peak reserved",
              "share of the baseline time", trace_title(trace), yfmt="{:.0%}", xticks=[])
    group = 1.0 / (len(modes) + 1)
    for i, ratio in enumerate(ratios):
        svg.text(ax.px(i + 0.5), ax.y + ax.h + 16, f"{ratio:.2f}", anchor="middle")
        for j, m in enumerate(modes):
            r = best[m].get(ratio)
            x0 = ax.px(i + group / 2 + j * group)
            w = ax.px(group) - ax.px(0) - 2
            if r is None:
                svg.text(x0 + w / 2, ax.py(0) - 4, missing_label(trace, m, ratio), size=9,
                         anchor="middle", color=MODE_COLOR[m])
                continue
            extra, stall = r["extra_compute_ns"] / base, max(r["stall_ns"], 0) / base
            svg.rect(x0, ax.py(extra), w, ax.py(0) - ax.py(extra), fill=MODE_COLOR[m])
            svg.rect(x0, ax.py(extra + stall), w, ax.py(extra) - ax.py(extra + stall), fill=MODE_COLOR[m],
                     opacity=0.35)
    entries = [(f"best {m}-mode run", MODE_COLOR[m], "") for m in modes]
    legend(svg, 700, 70, entries)
    y = 70 + 15 * len(entries) + 12
    svg.text(700, y, "solid: recompute (extra compute)", size=10, color="#555")
    svg.text(700, y + 14, "pale: stall (waiting for copies)", size=10, color="#555")
    svg.text(700, y + 28, "best: lowest overhead at that ratio", size=10, color="#555")
    footer(svg, f"{label}; {src}")
    write(svg, os.path.join(out, f"sim-cost-{slug(trace['name'])}.svg"), written)


def plot_sim_memory(trace, src, label, out, written):
    best = best_by_mode(trace)
    modes = [m for m in ("drop", "hybrid", "spill") if m in best]
    ratios = ratios_of(trace)
    peak = trace["peak_reserved"] / MiB
    svg = SVG(960, 420)
    ax = Axes(svg, 70, 60, 600, 290, (min(ratios) - 0.03, max(ratios) + 0.03), (0, peak * 1.1),
              "budget / unconstrained peak reserved", "MiB", trace_title(trace), xticks=ratios)
    ax.series([(r, r * peak) for r in ratios], "#888", "4,3")
    ax.hline(peak, "#000", "6,4", "unconstrained peak reserved")
    ax.hline(trace["peak_live_bytes"] / MiB, "#555", "2,3", "peak live bytes")
    ax.hline(trace["param_bytes"] / MiB, "#8c564b", "1,3", "parameters")
    for k, m in enumerate(modes):
        pts = []
        for ratio in ratios:
            r = best[m].get(ratio)
            pts.append((ratio, None if r is None else r["peak_reserved"] / MiB))
            if r is not None and r["evictions"]:
                svg.text(ax.px(ratio) + 5, ax.py(r["peak_reserved"] / MiB) + 12 + 11 * k, f"{r['evictions']} ev",
                         size=9, color=MODE_COLOR[m])
        ax.series(pts, MODE_COLOR[m], MODE_DASH[m])
    entries = [("budget", "#888", "4,3")] + [(f"peak reserved, best {m} run", MODE_COLOR[m], MODE_DASH[m])
                                              for m in modes]
    legend(svg, 700, 70, entries)
    y = 70 + 15 * len(entries) + 12
    for i, line in enumerate(("'N ev': evictions under pressure", "x on the top edge: out of memory",
                              "per-run peaks; memory over time:", "--timeline, sim-timeline-*.svg")):
        svg.text(700, y + 14 * i, line, size=10, color="#555")
    footer(svg, f"{label}; {src}")
    write(svg, os.path.join(out, f"sim-memory-{slug(trace['name'])}.svg"), written)


def plot_sim_overview(traces, label, ymax, out, written):
    cols = 3
    rows = math.ceil(len(traces) / cols)
    pw, ph = 300, 200
    svg = SVG(70 + cols * (pw + 70) + 170, 50 + rows * (ph + 80) + 20)
    svg.text(10, 22, f"Best overhead per mode and rotor's optimum, per trace ({label})", size=14, weight="bold")
    for i, (trace, src) in enumerate(traces):
        x = 70 + (i % cols) * (pw + 70)
        y = 70 + (i // cols) * (ph + 80)
        best = best_by_mode(trace)
        ratios = ratios_of(trace)
        vals = [r["overhead"] for m in best.values() for r in m.values() if r] + \
               [v for _, v in (rotor_points(trace) or []) if v is not None] + [0.05]
        top = min(max(vals) * 1.08, ymax)
        ax = Axes(svg, x, y, pw, ph, (min(ratios), max(ratios)), (0, top), "budget ratio", "",
                  slug(trace["name"]), yfmt="{:.0%}", xticks=ratios)
        rp = rotor_points(trace)
        if rp:
            ax.series(rp, "#000", "6,4")
        for m in ("drop", "hybrid", "spill"):
            if m in best:
                ax.series([(ratio, r["overhead"] if r else None) for ratio, r in best[m].items()],
                          MODE_COLOR[m], MODE_DASH[m])
    legend(svg, svg.width - 160, 80, [("rotor optimum", "#000", "6,4")] +
           [(f"best {m}", MODE_COLOR[m], MODE_DASH[m]) for m in ("drop", "hybrid", "spill")])
    svg.text(svg.width - 160, 80 + 15 * 4 + 10, "x: no policy finished", size=10, color="#555")
    svg.text(svg.width - 160, 80 + 15 * 4 + 38, "(black x: rotor infeasible)", size=10, color="#555")
    svg.text(svg.width - 160, 80 + 15 * 4 + 24, f"triangle: above {ymax:.0%}", size=10, color="#555")
    write(svg, os.path.join(out, "sim-overview.svg"), written)


def sim_markdown(traces, label):
    """Markdown: per trace, the best overhead per mode (policy) and rotor's, per ratio."""
    lines = [f"Overhead (time / baseline - 1) of the best policy per mode; OOM: every policy ran out of "
             f"memory; failed: none finished, some with an error or a wrong read; rotor: its optimum's "
             f"extra compute ({label}).", ""]
    for trace, src in traces:
        best = best_by_mode(trace)
        ratios = sorted(ratios_of(trace), reverse=True)
        rotor = dict(rotor_points(trace) or [])
        lines.append(f"**{slug(trace['name'])}** ({src}): peak {trace['peak_reserved'] / MiB:.0f} MiB reserved, "
                     f"params {trace['param_bytes'] / MiB:.0f} MiB, baseline {trace['baseline_ns'] / 1e6:.2f} ms")
        lines.append("")
        lines.append("| mode | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
        lines.append("|---|" + "---|" * len(ratios))
        if rotor:
            lines.append("| rotor | " + " | ".join("infeasible" if rotor.get(r) is None else f"{rotor[r]:.1%}"
                                                  for r in ratios) + " |")
        for m in ("drop", "hybrid", "spill"):
            if m in best:
                cells = []
                for r in ratios:
                    run = best[m].get(r)
                    cells.append(missing_label(trace, m, r) if run is None
                                 else f"{run['overhead']:.1%} ({run['policy']})")
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ================================================================================================
# train_bench JSON
# ================================================================================================

def train_doc(path):
    d = load_json(path, "a train_bench.py --json document")
    if d.get("tool") != "train_bench" or not isinstance(d.get("results"), list):
        raise InputError(f"{path}: not a train_bench.py --json document (no tool/results)")
    return d


def device_label(doc):
    env = doc.get("environment") or {}
    dev = env.get("device") or "unknown device"
    if dev == "cpu":
        return "CPU harness check (--smoke), not a measurement"
    return f"{dev}, torch {env.get('torch')}"


def plot_train_model(model, results, doc, src, ymax, out, written):
    ref = next((r for r in results if r.get("ratio") is None and r.get("status") == "ok"), None)
    runs = [r for r in results if r.get("ratio") is not None and r.get("status") != "skipped"]
    if ref is None or not runs:
        return
    gpu = ref.get("peak_reserved") is not None
    base_mem = ref["peak_reserved"] if gpu else ref.get("saved_activation_bytes")
    ratios = sorted({r["ratio"] for r in runs})
    configs = sorted({r["config"] for r in runs})
    svg = SVG(1180, 420)
    over = {c: [(r["ratio"], r["step_ms_median"] / ref["step_ms_median"] - 1 if r["status"] == "ok" else None)
                for r in runs if r["config"] == c] for c in configs}
    top = min(max([y for p in over.values() for _, y in p if y is not None] + [0.05]) * 1.08, ymax)
    xl = (min(ratios) - 0.02, max(ratios) + 0.02)
    a1 = Axes(svg, 70, 60, 400, 290, xl, (min(0, min([y for p in over.values() for _, y in p if y is not None] + [0])), top),
              "budget / unconstrained peak", "step time overhead", f"{model}: step time", yfmt="{:.0%}",
              xticks=ratios)
    entries = []
    for i, c in enumerate(configs):
        a1.series(over[c], COLORS[i % len(COLORS)])
        entries.append((c, COLORS[i % len(COLORS)], ""))
    if gpu and base_mem:
        mem = {c: [(r["ratio"], r["peak_reserved"] / base_mem if r.get("peak_reserved") else None)
                   for r in runs if r["config"] == c] for c in configs}
        a2 = Axes(svg, 560, 60, 400, 290, xl, (0, 1.2), "budget / unconstrained peak",
                  "peak reserved / unconstrained peak", f"{model}: memory", yfmt="{:.1f}", xticks=ratios)
        a2.series([(r, r) for r in ratios], "#888", "4,3")
        for i, c in enumerate(configs):
            a2.series(mem[c], COLORS[i % len(COLORS)])
        entries.append(("budget", "#888", "4,3"))
    else:
        svg.text(560, 200, "peak reserved: GPU only (null in a CPU run)", color="#555")
    legend(svg, 990, 70, entries)
    svg.text(990, 70 + 15 * len(entries) + 12, "x on the top edge: did not finish", size=10, color="#555")
    svg.text(990, 70 + 15 * len(entries) + 26, "(OOM, error, timeout or crash:", size=10, color="#555")
    svg.text(990, 70 + 15 * len(entries) + 40, "the JSON's status)", size=10, color="#555")
    footer(svg, f"{device_label(doc)}; {src}; commit {str(doc.get('commit'))[:10]}")
    write(svg, os.path.join(out, f"train-{slug(model)}.svg"), written)


TIMELINE_MARKS = [("spills", "#ff7f0e"), ("drops", "#d62728"), ("restores", "#1f77b4"), ("recomputes", "#9467bd"),
                  ("eager_drops", "#7f7f7f")]  # the last: the simulator's drops at release only


def draw_timeline(tl, curves, limit, limit_label, title, foot, path, written):
    """Memory over one step from a timeline ({"fields": [...], "samples": [[...], ...]}, as
    train_bench --timeline and spillway-evict-sim --timeline write it): `curves` (field, colour,
    dash) against t_ms, a line at `limit`, and a tick in each counter's row where it grew (for the
    counters the timeline has)."""
    idx = {f: i for i, f in enumerate(tl["fields"])}
    samples = tl["samples"]
    t = [s[idx["t_ms"]] for s in samples]
    top = max([s[idx[c]] or 0 for s in samples for c, _, _ in curves] + [limit or 0]) / MiB * 1.1 or 1
    svg = SVG(1080, 440)
    ax = Axes(svg, 70, 60, 760, 290, (0, t[-1] or 1), (0, top), "ms into the step", "MiB", title, xfmt="{:.0f}")
    for c, color, dash in curves:
        ax.series([(ti, (s[idx[c]] or 0) / MiB) for ti, s in zip(t, samples)], color, dash)
    if limit:
        ax.hline(limit / MiB, "#d62728", "6,4", limit_label)
    marks = [(f, col) for f, col in TIMELINE_MARKS if f in idx]
    for k, (field, color) in enumerate(marks):
        prev = samples[0][idx[field]] or 0
        for ti, s in zip(t, samples):
            v = s[idx[field]] or 0
            if v > prev:  # a tick in this counter's row along the bottom of the plot
                svg.line(ax.px(ti), ax.y + ax.h - 4 - 7 * k, ax.px(ti), ax.y + ax.h - 10 - 7 * k, color, 2)
            prev = v
    entries = [(c.replace("_", " "), col, dash) for c, col, dash in curves] + \
              [(f"{f.replace('_', ' ')} happened (tick)", col, "") for f, col in marks]
    legend(svg, 860, 70, entries)
    footer(svg, foot)
    write(svg, path, written)


def plot_timeline(r, doc, src, out, written):
    tl = r["timeline"]
    idx = {f: i for i, f in enumerate(tl["fields"])}
    samples = tl["samples"]
    if len(samples) < 2:
        return
    gpu = samples[0][idx["allocated"]] is not None
    curves = ([("allocated", "#1f77b4", ""), ("reserved", "#ff7f0e", "")] if gpu else []) + \
        ([("resident_activation_bytes", "#2ca02c", "")] if any(s[idx["resident_activation_bytes"]] is not None
                                                            for s in samples) else [])
    if not curves:
        return
    ratio = "unconstrained" if r.get("ratio") is None else f"ratio {r['ratio']:.2f}"
    name = f"timeline-{slug(r['model'])}-{slug(r['config'])}-{'unconstrained' if r.get('ratio') is None else r['ratio']}.svg"
    draw_timeline(tl, curves, r.get("budget_bytes") if gpu else r.get("max_resident_bytes"),
                  "budget" if gpu else "max_resident",
                  f"{r['model']} {r['config']} {ratio}: memory over one step", f"{device_label(doc)}; {src}",
                  os.path.join(out, name), written)


def plot_sim_timeline(trace, run, src, label, out, written):
    """A simulator run's timeline (spillway-evict-sim --json --timeline): allocated, reserved and
    the engine's resident bytes over the measured step, in simulated time, with its budget."""
    if len(run["timeline"]["samples"]) < 2:
        return
    state = "" if run["ok"] else ", out of memory where it ends"
    title = f"{trace['name']} {run['policy']}/{run['mode']} at {run['ratio']:.2f}: memory over one step{state}"
    # The engine's resident bytes are nearly the allocator's allocated ones: dashed, over them.
    curves = [("reserved", "#ff7f0e", ""), ("allocated", "#1f77b4", ""), ("resident", "#2ca02c", "4,3")]
    name = f"sim-timeline-{slug(trace['name'])}-{slug(run['policy'])}-{run['mode']}-{run['ratio']}.svg"
    draw_timeline(run["timeline"], curves, run["budget"], "budget", title, f"{label}; {src}",
                  os.path.join(out, name), written)


# ================================================================================================
# Entry
# ================================================================================================

def expand(patterns):
    files = []
    for p in patterns or []:
        hits = sorted(glob.glob(p))
        files += hits if hits else [p]
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description="Dependency-free SVG plots of spillway-evict-sim --json and "
                                            "train_bench.py --json results.")
    p.add_argument("--sim", nargs="*", default=[], metavar="FILE", help="spillway-evict-sim --json files")
    p.add_argument("--train", nargs="*", default=[], metavar="FILE", help="train_bench.py --json documents")
    p.add_argument("--out", required=True, help="directory for the SVG files (created)")
    p.add_argument("--label", default=None, help=f"label on every simulator plot (default: {SIM_LABEL!r})")
    p.add_argument("--ymax", type=float, default=3.0, help="overheads above are clipped (default 3.0 = 300%%)")
    p.add_argument("--policies", default="", help="only these policies in sim-overhead plots (comma-separated)")
    p.add_argument("--modes", default="", help="only these modes in sim-overhead plots (drop, hybrid, spill)")
    p.add_argument("--markdown", metavar="FILE", help="also write the simulator's best-per-mode tables here")
    a = p.parse_args(argv)
    if not a.sim and not a.train:
        p.error("nothing to plot: give --sim FILE... and/or --train FILE...")
    if not a.ymax > 0:
        p.error(f"--ymax {a.ymax} is invalid: expected a number > 0")
    modes = {m for m in a.modes.split(",") if m}
    for m in modes:
        if m not in MODE_DASH:
            p.error(f"--modes entry {m!r} is unknown: expected drop, hybrid or spill")
    policies = {x for x in a.policies.split(",") if x}
    os.makedirs(a.out, exist_ok=True)
    written = []
    try:
        all_traces = []
        for path in expand(a.sim):
            d = sim_traces(path)
            label = a.label or SIM_LABEL
            src = os.path.basename(path)
            for trace in d["traces"]:
                plot_sim_overhead(trace, src, label, a.ymax, policies, modes, a.out, written)
                plot_sim_cost(trace, src, label, a.out, written)
                plot_sim_memory(trace, src, label, a.out, written)
                for run in trace["runs"]:
                    if run.get("timeline"):
                        plot_sim_timeline(trace, run, src, label, a.out, written)
                all_traces.append((trace, src))
        if all_traces:
            plot_sim_overview(all_traces, a.label or SIM_LABEL, a.ymax, a.out, written)
            if a.markdown:
                with open(a.markdown, "w") as f:
                    f.write(sim_markdown(all_traces, a.label or SIM_LABEL) + "\n")
                written.append(a.markdown)
        for path in expand(a.train):
            d = train_doc(path)
            src = os.path.basename(path)
            train = [r for r in d["results"] if r.get("kind", "train") == "train" and not r.get("search")]
            for model in sorted({r["model"] for r in train if r.get("model")}):
                plot_train_model(model, [r for r in train if r.get("model") == model], d, src, a.ymax, a.out, written)
            for r in train:
                if r.get("timeline") and r.get("status") == "ok":
                    plot_timeline(r, d, src, a.out, written)
    except InputError as e:
        print(f"plot_results: {e}", file=sys.stderr)
        return 1
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
