// evict_sim_run: one replay of an operator trace. The model is described in evict_sim_run.hpp.
#include "evict_sim_run.hpp"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>

#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/sim_device.hpp"

namespace spillway::evsim {

using op_trace::never;
using op_trace::trace_data;

std::string to_string(engine_mode m) {
  switch (m) {
    case engine_mode::none: return "none";
    case engine_mode::hybrid: return "hybrid";
    case engine_mode::drop_only: return "drop";
    case engine_mode::spill_only: return "spill";
  }
  return "?";
}

engine_mode parse_mode(const std::string& s) {
  if (s == "hybrid") return engine_mode::hybrid;
  if (s == "drop") return engine_mode::drop_only;
  if (s == "spill") return engine_mode::spill_only;
  throw spillway::invalid_argument("unknown engine mode \"" + s + "\"; expected hybrid, drop or spill");
}

double run_result::decision_median_ns() const {
  if (decision_samples.empty()) return 0;
  auto s = decision_samples;
  std::sort(s.begin(), s.end());
  std::uint64_t total = 0;
  for (const auto& [ns, n] : s) total += n;
  std::uint64_t seen = 0;
  for (const auto& [ns, n] : s) {
    seen += n;
    if (2 * seen >= total) return ns;
  }
  return s.back().first;
}

namespace {

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
std::uint64_t mix(std::uint64_t h, std::uint64_t v) { return splitmix(h ^ splitmix(v)); }

// Signatures: what each buffer must hold (at its start, middle and end), and the kernels' effects.
class verifier {
 public:
  explicit verifier(const trace_data& t) : t_(t), expected_(t.buffers.size(), 0) {
    for (std::size_t b = 0; b < t.buffers.size(); ++b) expected_[b] = mix(0x5eed, b);
    for (std::size_t k = 0; k < t.ops.size(); ++k) {
      std::uint64_t h = splitmix(k);
      for (std::uint32_t in : t.ops[k].inputs) h = mix(h, masked(in, expected_[in]));
      for (std::size_t j = 0; j < t.ops[k].outputs.size(); ++j) expected_[t.ops[k].outputs[j]] = mix(h, j);
    }
  }

  void write_param(std::uint32_t b, void* p) { write(b, p, expected_[b]); }

  // The effect of op k's kernel.
  void run(std::size_t k, const std::vector<void*>& in, const std::vector<void*>& out) {
    const op_trace::op& o = t_.ops[k];
    std::uint64_t h = splitmix(k);
    for (std::size_t i = 0; i < in.size(); ++i) {
      const std::uint32_t b = o.inputs[i];
      bool same = true;
      const std::uint64_t v = read(b, in[i], same);
      ++checks;
      if (!same || v != masked(b, expected_[b])) ++mismatches;
      h = mix(h, v);
    }
    for (std::size_t j = 0; j < out.size(); ++j) write(o.outputs[j], out[j], mix(h, j));
  }

  std::uint64_t checks = 0;
  std::uint64_t mismatches = 0;

 private:
  std::size_t width(std::uint32_t b) const { return std::min<std::uint64_t>(8, t_.buffers[b].bytes); }
  std::uint64_t masked(std::uint32_t b, std::uint64_t v) const {
    const std::size_t w = width(b);
    return w == 8 ? v : v & ((std::uint64_t{1} << (8 * w)) - 1);
  }
  std::size_t offset(std::uint32_t b, int which) const {
    const std::uint64_t bytes = t_.buffers[b].bytes;
    return which == 0 ? 0 : which == 1 ? static_cast<std::size_t>((bytes / 2) & ~std::uint64_t{7}) : bytes - width(b);
  }
  void write(std::uint32_t b, void* p, std::uint64_t v) {
    for (int w = 0; w < 3; ++w) std::memcpy(static_cast<char*>(p) + offset(b, w), &v, width(b));
  }
  std::uint64_t read(std::uint32_t b, const void* p, bool& same) const {
    std::uint64_t v[3] = {0, 0, 0};
    for (int w = 0; w < 3; ++w) std::memcpy(&v[w], static_cast<const char*>(p) + offset(b, w), width(b));
    same = v[0] == v[1] && v[1] == v[2];
    return v[0];
  }

  const trace_data& t_;
  std::vector<std::uint64_t> expected_;
};

class replayer {
 public:
  replayer(const trace_data& t, const op_trace::liveness& l, const run_config& c) : t_(t), l_(l), c_(c), check_(t) {
    dying_.resize(t.ops.size());
    for (std::uint32_t b = 0; b < t.buffers.size(); ++b) {
      if (l.dies_after[b] != never && (l.produced_by[b] != never || t.buffers[b].param)) dying_[l.dies_after[b]].push_back(b);
    }
    consumers_.resize(t.buffers.size());
    for (std::size_t k = 0; k < t.ops.size(); ++k) {
      for (std::uint32_t b : t.ops[k].inputs) consumers_[b].push_back(k);
    }
    live_outputs_.assign(t.ops.size(), 0);
    raw_.assign(t.buffers.size(), nullptr);
    ids_.assign(t.buffers.size(), {});
    alive_.assign(t.buffers.size(), false);
  }

  // One line per segment, lowest address first: its offset from the lowest, pool, size, and its
  // blocks (A: allocated, -: free) in MiB. What out of memory looked like, for --oom-layout.
  void print_layout(std::size_t op) const {
    const memory_snapshot snap = alloc_->snapshot();
    std::vector<const segment_info*> segs;
    for (const segment_info& sg : snap.segments) segs.push_back(&sg);
    std::sort(segs.begin(), segs.end(), [](auto* a, auto* b) { return a->address < b->address; });
    std::fprintf(stderr, "-- %s/%s: segments at out of memory, op %zu (MiB; A allocated, - free)\n",
                 c_.policy.c_str(), to_string(c_.mode).c_str(), op);
    for (const segment_info* sg : segs) {
      std::fprintf(stderr, "  +%-8.2f %s %8.2f:", static_cast<double>(sg->address - segs.front()->address) / 1048576.0,
                   sg->is_large ? "large" : "small", static_cast<double>(sg->total_size) / 1048576.0);
      for (const block_info& b : sg->blocks)
        std::fprintf(stderr, " %s%.2f", b.allocated() ? "A" : "-", static_cast<double>(b.size) / 1048576.0);
      std::fputc('\n', stderr);
    }
  }

  run_result run() {
    const auto started = std::chrono::steady_clock::now();
    run_result r;
    try {
      setup(r);
      warming_up_ = true;
      for (std::size_t step = 0; step < c_.warmup_steps; ++step) {  // unmeasured: they teach the engine
        start_step();
        for (std::size_t k = 0; k < t_.ops.size(); ++k) {
          r.ops_done = k;
          run_op(k);
          release_after(k);
        }
        end_step();
      }
      warming_up_ = false;
      r.ops_done = 0;
      measured_ = mark_start();
      start_step();
      const std::size_t timeline_window = (t_.ops.size() + max_timeline_samples - 2) / (max_timeline_samples - 1);
      if (c_.timeline) sample_timeline(r, 0);
      const std::size_t stride = std::max<std::size_t>(1, t_.ops.size() / std::max<std::size_t>(1, c_.candidate_samples));
      std::size_t next_count_op = 0;  // candidate counts: at the first op with pressure from here
      const std::size_t window = std::max<std::size_t>(1, t_.ops.size() / 2000);
      std::size_t next_sample_op = 0;
      bool pressured_since_sample = false;
      for (std::size_t k = 0; k < t_.ops.size(); ++k) {
        const std::int64_t calls = alloc_->stats().num_pressure_handler_calls;
        run_op(k);
        // Decision samples: engine_stats() walks every buffer, so one sample covers a window of
        // ops with pressure (a window mean) when there are many.
        if (engine_ && alloc_->stats().num_pressure_handler_calls != calls) {
          pressured_since_sample = true;
          if (k >= next_sample_op) {
            sample_decisions(r, k >= next_count_op);
            if (k >= next_count_op) next_count_op = k + stride;
            next_sample_op = k + window;
            pressured_since_sample = false;
          }
        }
        release_after(k);
        r.ops_done = k + 1;
        if (c_.timeline && ((k + 1) % timeline_window == 0 || k + 1 == t_.ops.size())) sample_timeline(r, k + 1);
      }
      if (engine_ && pressured_since_sample) sample_decisions(r, false);
      r.total_ns = sim_->now_ns() - measured_.time_ns;
      r.ok = true;
    } catch (const spillway::out_of_memory& e) {
      if (c_.oom_layout && alloc_) print_layout(r.ops_done);
      // The decisions of the op that failed, in the measured step (the median counts them too).
      if (engine_ && !warming_up_) sample_decisions(r, false);
      r.out_of_memory = true;
      r.failure = "out of memory at op " + std::to_string(r.ops_done) + where(r.ops_done) + ": " + first_line(e.what());
    } catch (const std::exception& e) {
      r.failure = "error at op " + std::to_string(r.ops_done) + where(r.ops_done) + ": " + first_line(e.what());
    }
    if (alloc_) {
      for (void* p : unregistered_) alloc_->deallocate(p);
      unregistered_.clear();
      const memory_stats s = alloc_->stats();
      r.peak_reserved = static_cast<std::size_t>(s.reserved_bytes[0].peak);
      r.peak_allocated = static_cast<std::size_t>(s.allocated_bytes[0].peak);
      r.device_syncs = s.num_sync_all_streams;
      r.device_allocs = s.num_device_alloc;
      r.device_frees = s.num_device_free;
      r.releases_before_eviction = s.num_releases_before_eviction;
    }
    if (engine_) r.engine = since(engine_->stats(), measured_.engine);
    r.device_syncs -= measured_.device_syncs;
    r.device_allocs -= measured_.device_allocs;
    r.device_frees -= measured_.device_frees;
    r.releases_before_eviction -= measured_.releases_before_eviction;
    r.eager_drops = eager_drops_ - measured_.eager_drops;
    r.verify_checks = check_.checks;
    r.verify_mismatches = check_.mismatches;
    engine_.reset();
    for (std::uint32_t b = 0; b < raw_.size(); ++b) {
      if (raw_[b] != nullptr) alloc_->deallocate(raw_[b]);
    }
    if (sim_) sim_->run_until_idle();
    r.allocator_warnings = warnings_;
    r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return r;
  }

 private:
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }
  std::string where(std::size_t k) const {
    const std::string step = warming_up_ ? ", a warm-up step" : "";
    return k < t_.ops.size() ? " (" + t_.ops[k].name + step + ")" : step;
  }

  // Where the measured step began: its time and the counters the results are measured from.
  struct measured_start {
    std::uint64_t time_ns = 0;
    eviction::engine_stats engine;
    std::int64_t device_syncs = 0, device_allocs = 0, device_frees = 0, releases_before_eviction = 0;
    std::uint64_t eager_drops = 0;
  };
  measured_start mark_start() {
    measured_start m;
    m.time_ns = sim_->now_ns();
    if (engine_) {
      m.engine = engine_->stats();
      last_decisions_ = m.engine.decisions;
      last_decision_ns_ = m.engine.decision_time_ns;
    }
    const memory_stats s = alloc_->stats();
    m.device_syncs = s.num_sync_all_streams;
    m.device_allocs = s.num_device_alloc;
    m.device_frees = s.num_device_free;
    m.releases_before_eviction = s.num_releases_before_eviction;
    m.eager_drops = eager_drops_;
    return m;
  }

  // The engine's counters since `then` (gauges such as pinned bytes are as they are now).
  static eviction::engine_stats since(eviction::engine_stats s, const eviction::engine_stats& then) {
    s.evictions -= then.evictions;
    s.spills -= then.spills;
    s.drops -= then.drops;
    s.restores -= then.restores;
    s.recomputes -= then.recomputes;
    s.plan_holds_released -= then.plan_holds_released;
    s.pin_holds_released -= then.pin_holds_released;
    s.bytes_spilled -= then.bytes_spilled;
    s.bytes_restored -= then.bytes_restored;
    s.bytes_recomputed -= then.bytes_recomputed;
    s.recompute_cost_ns -= then.recompute_cost_ns;
    s.moves -= then.moves;
    s.bytes_moved -= then.bytes_moved;
    s.segments_emptied -= then.segments_emptied;
    s.host_allocation_failures -= then.host_allocation_failures;
    s.pressure_calls -= then.pressure_calls;
    s.decisions -= then.decisions;
    s.decision_time_ns -= then.decision_time_ns;
    s.upkeep_steps -= then.upkeep_steps;
    s.upkeep_time_ns -= then.upkeep_time_ns;
    s.next_use_mismatches -= then.next_use_mismatches;
    return s;
  }

  // A step begins: the parameters and inputs that are not alive are allocated (registered before
  // begin_step, outside the step's keys), then, with warm-up steps, the step is marked.
  void start_step() {
    allocate_params();
    if (engine_ && c_.warmup_steps > 0) engine_->begin_step();
  }

  // Between steps: what the step left alive (gradients, the loss), except the parameters, goes,
  // as the optimizer step would consume it.
  void end_step() {
    for (std::uint32_t b = 0; b < alive_.size(); ++b) {
      if (!alive_[b] || (t_.buffers[b].param && l_.produced_by[b] == never)) continue;
      if (engine_) {
        engine_->forget(ids_[b]);
        ids_[b] = {};
      } else {
        alloc_->deallocate(raw_[b]);
        raw_[b] = nullptr;
      }
      alive_[b] = false;
    }
    std::fill(live_outputs_.begin(), live_outputs_.end(), 0);
    sim_->run_until_idle();
  }

  void setup(run_result&) {
    const op_trace::trace_summary s = op_trace::summarize(t_);
    sim_config sc;
    sc.capacity = c_.capacity != 0 ? c_.capacity : 2 * s.peak_live_bytes + (std::size_t{1} << 30);
    if (c_.budget != unlimited_budget) sc.capacity = std::max(sc.capacity, c_.budget + (std::size_t{256} << 20));
    sc.h2d_bandwidth = sc.d2h_bandwidth = c_.link_bandwidth;
    sc.segment_reserve_latency_ns = sc.page_map_latency_ns = c_.driver_latency_ns;
    sc.device_sync_latency_ns = c_.sync_latency_ns;
    sim_ = std::make_shared<sim_device>(sc);
    allocator_config ac;
    ac.budget = c_.budget;
    ac.expandable_segments = c_.expandable;
    ac.max_split_size = c_.max_split_size;
    ac.on_warning = [this](const std::string&) { ++warnings_; };
    alloc_ = std::make_unique<device_allocator>(sim_, ac);
    stream_ = sim_->create_stream();
    if (c_.mode == engine_mode::none) return;
    eviction::engine_config ec;
    ec.policy = c_.policy;
    ec.seed = c_.seed;
    ec.allow_spill = c_.mode != engine_mode::drop_only;
    ec.allow_drop = c_.mode != engine_mode::spill_only;
    ec.max_recompute_depth = 1000000;
    ec.max_recompute_factor = c_.max_recompute_factor;
    ec.compact = c_.compact;
    ec.clock = [s = sim_.get()] { return s->now_ns(); };
    engine_.emplace(*alloc_, ec);
  }

  // The trace's parameters and inputs, those not alive (all of them before the first step; those
  // the last step released, such as its input batch or parameters it updated in place, after it).
  void allocate_params() {
    for (std::uint32_t b = 0; b < t_.buffers.size(); ++b) {
      if (!t_.buffers[b].param || l_.produced_by[b] != never || alive_[b]) continue;
      void* p = alloc_->allocate(t_.buffers[b].bytes, stream_);
      if (c_.verify) check_.write_param(b, p);
      adopt(b, p, {}, 0);
    }
  }

  // Takes ownership of a fresh block for buffer b: registered with the engine, or kept raw.
  void adopt(std::uint32_t b, void* p, eviction::node_id producer, std::uint32_t index) {
    alive_[b] = true;
    if (!engine_) {
      raw_[b] = p;
      return;
    }
    eviction::buffer_options o;
    o.producer = producer;
    o.output_index = index;
    o.evictable = !t_.buffers[b].param;
    ids_[b] = engine_->register_buffer(p, t_.buffers[b].bytes, stream_, o);
  }

  eviction::compute_fn kernel(std::size_t k) {
    const std::uint64_t ns = t_.ops[k].duration_ns;
    if (!c_.verify) {
      return [s = sim_.get(), ns](std::span<void* const>, std::span<void* const>, stream_ref st) { s->launch(st, ns); };
    }
    return [s = sim_.get(), ns, k, v = &check_](std::span<void* const> in, std::span<void* const> out, stream_ref st) {
      s->launch(st, ns, [v, k, i = std::vector<void*>(in.begin(), in.end()), o = std::vector<void*>(out.begin(), out.end())] {
        v->run(k, i, o);
      });
    };
  }

  void run_op(std::size_t k) {
    const op_trace::op& o = t_.ops[k];
    std::vector<eviction::pinned_buffer> pins;
    std::vector<void*> in(o.inputs.size()), out(o.outputs.size());
    if (engine_) {
      // Together, as DTR locks an operator's arguments: bringing back one input never evicts another.
      std::vector<eviction::buffer_id> inputs;
      inputs.reserve(o.inputs.size());
      for (std::uint32_t b : o.inputs) inputs.push_back(ids_[b]);
      pins = engine_->pin_all(inputs);
      for (std::size_t i = 0; i < o.inputs.size(); ++i) in[i] = pins[i].get();
    } else {
      for (std::size_t i = 0; i < o.inputs.size(); ++i) in[i] = raw_[o.inputs[i]];
    }
    for (std::size_t j = 0; j < o.outputs.size(); ++j) {
      out[j] = alloc_->allocate(t_.buffers[o.outputs[j]].bytes, stream_);
      unregistered_.push_back(out[j]);
    }
    const eviction::compute_fn compute = kernel(k);
    compute(in, out, stream_);
    eviction::node_id node;
    if (engine_ && c_.mode != engine_mode::spill_only && !o.outputs.empty()) {
      std::vector<eviction::buffer_id> inputs;
      inputs.reserve(o.inputs.size());
      for (std::uint32_t b : o.inputs) inputs.push_back(ids_[b]);
      node = engine_->add_node({o.name, std::move(inputs), o.outputs.size(), compute, static_cast<double>(o.duration_ns)});
      live_outputs_[k] = static_cast<std::uint32_t>(o.outputs.size());
    }
    for (std::size_t j = 0; j < o.outputs.size(); ++j) {
      adopt(o.outputs[j], out[j], node, static_cast<std::uint32_t>(j));
      unregistered_.erase(std::find(unregistered_.begin(), unregistered_.end(), out[j]));
    }
    sim_->synchronize_stream(stream_);
    pins.clear();
  }

  // Releases the buffers whose life ends after op k (see eager_drop in evict_sim_run.hpp).
  void release_after(std::size_t k) {
    const std::vector<std::uint32_t>& dying = dying_[k];
    if (!engine_) {
      for (std::uint32_t b : dying) {
        alloc_->deallocate(raw_[b]);
        raw_[b] = nullptr;
        alive_[b] = false;
      }
      return;
    }
    for (std::uint32_t b : dying) {
      if (l_.produced_by[b] != never && live_outputs_[l_.produced_by[b]] > 0) --live_outputs_[l_.produced_by[b]];
    }
    if (c_.eager_drop && c_.mode != engine_mode::spill_only) {
      for (std::uint32_t b : dying) {
        if (t_.buffers[b].param || l_.produced_by[b] == never) continue;
        const bool needed = std::any_of(consumers_[b].begin(), consumers_[b].end(),
                                        [&](std::size_t c) { return live_outputs_[c] > 0; });
        if (needed && !rebuilds_dropped(b) && engine_->state(ids_[b]) == eviction::buffer_state::resident &&
            engine_->evict(ids_[b], eviction::eviction_mode::drop)) {
          ++eager_drops_;
        }
      }
    }
    for (std::uint32_t b : dying) {
      engine_->forget(ids_[b]);
      ids_[b] = {};
      alive_[b] = false;
    }
  }

  // True when a dropped output of a live consumer of b would be recomputed from b: dropping b too
  // would chain that recompute to b's own ancestors (a gradient dropped early in the backward
  // would be rebuilt from the loss). Such a b stays resident, an ordinary candidate whose cost
  // includes that chain (docs/simulator.md, "Release").
  bool rebuilds_dropped(std::uint32_t b) const {
    for (std::size_t c : consumers_[b]) {
      if (live_outputs_[c] == 0) continue;
      for (std::uint32_t o : t_.ops[c].outputs) {
        if (alive_[o] && engine_->state(ids_[o]) == eviction::buffer_state::dropped) return true;
      }
    }
    return false;
  }

  // A timeline point after `ops` ops of the measured step (engine_stats walks every buffer: at
  // most max_timeline_samples per run).
  void sample_timeline(run_result& r, std::size_t ops) {
    timeline_sample p;
    p.op = static_cast<std::uint32_t>(ops);
    p.t_ns = sim_->now_ns() - measured_.time_ns;
    const memory_stats m = alloc_->stats();
    p.allocated = static_cast<std::uint64_t>(m.allocated_bytes[0].current);
    p.reserved = static_cast<std::uint64_t>(m.reserved_bytes[0].current);
    if (engine_) {
      const eviction::engine_stats s = since(engine_->stats(), measured_.engine);
      p.resident = s.resident_bytes;
      p.spills = s.spills;
      p.eager_drops = eager_drops_ - measured_.eager_drops;
      p.drops = s.drops - p.eager_drops;
      p.restores = s.restores;
      p.recomputes = s.recomputes;
    }
    r.timeline.push_back(p);
  }

  void sample_decisions(run_result& r, bool count_candidates) {
    const eviction::engine_stats s = engine_->stats();
    const std::uint64_t n = s.decisions - last_decisions_;
    if (n > 0) r.decision_samples.emplace_back((s.decision_time_ns - last_decision_ns_) / static_cast<double>(n), n);
    last_decisions_ = s.decisions;
    last_decision_ns_ = s.decision_time_ns;
    if (!count_candidates) return;
    std::size_t candidates = 0;
    for (std::uint32_t b = 0; b < alive_.size(); ++b) {
      if (alive_[b] && !t_.buffers[b].param && engine_->state(ids_[b]) == eviction::buffer_state::resident) ++candidates;
    }
    r.max_candidates = std::max(r.max_candidates, candidates);
  }

  const trace_data& t_;
  const op_trace::liveness& l_;
  const run_config& c_;
  verifier check_;
  std::vector<std::vector<std::uint32_t>> dying_;
  std::vector<std::vector<std::size_t>> consumers_;
  std::vector<std::uint32_t> live_outputs_;  // per op: outputs not yet released (ops with a node)
  std::vector<void*> raw_;                   // per buffer, without an engine
  std::vector<eviction::buffer_id> ids_;     // per buffer, with an engine
  std::vector<bool> alive_;
  std::vector<void*> unregistered_;          // outputs allocated but not yet handed over
  std::shared_ptr<sim_device> sim_;
  std::unique_ptr<device_allocator> alloc_;
  std::optional<eviction::eviction_engine> engine_;
  stream_ref stream_;
  std::uint64_t eager_drops_ = 0;
  std::uint64_t warnings_ = 0;
  std::uint64_t last_decisions_ = 0;
  double last_decision_ns_ = 0;
  bool warming_up_ = false;
  measured_start measured_;  // zero until the measured step has begun
};

}  // namespace

run_result replay(const trace_data& trace, const op_trace::liveness& live, const run_config& config) {
  replayer r(trace, live, config);
  return r.run();
}

void run_with_large_stack(const std::function<void()>& f) {
  struct job {
    const std::function<void()>* f;
    std::exception_ptr error;
  } j{&f, nullptr};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, std::size_t{1} << 30);  // reserved, touched only as used
  pthread_t thread;
  const auto body = [](void* p) -> void* {
    auto* jb = static_cast<job*>(p);
    try {
      (*jb->f)();
    } catch (...) {
      jb->error = std::current_exception();
    }
    return nullptr;
  };
  const int rc = pthread_create(&thread, &attr, body, &j);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    f();  // no thread: run here
    return;
  }
  pthread_join(thread, nullptr);
  if (j.error) std::rethrow_exception(j.error);
}

}  // namespace spillway::evsim
