// spillway-policy-bench: the time of one eviction decision (eviction_policy::choose) per policy.
//
//   spillway-policy-bench [--candidates N] [--calls CALLS] [--seed S] [--case NAME] [--json] [--smoke]
//
// The candidates (default 10,000) live in a synthetic candidate_view shaped like the engine's:
// at(i) reads a vector, least_recently_used(), largest() and cheapest_per_byte() return what the
// engine's indexes would hand back in O(1), and contiguous_if_evicted(id) does what the engine's
// does: a find in the engine's registry (id -> device pointer), then, under a mutex as
// device_allocator's coalesced_size_if_freed takes, a find in the allocator's blocks (the
// candidates' plus 4x as many others, random 64-bit keys). The tool measures and prints that cost. Sizes are log-uniform over
// 64 KiB..256 MiB, 90% on the compute stream, and blocks of 1 MiB or less are in the small pool.
//
// Cases (--case NAME runs one): dtr, lru, largest; dtr-frag with a 32 MiB request on the compute
// stream (some sampled candidates fit by size); dtr-frag-nofit, a request nothing fits, so
// dtr-frag spends its whole budget of range lookups (its worst case).
//
// Each choose() call is timed on its own with steady_clock, after 1,000 warm-up calls; the figures
// are the median, p10, p90 and p99 over --calls calls (default 200,000; --smoke: 500), and the mean
// over all of them. The clock's own cost (printed) is included. The target is a median of at most
// 5 us per decision with 10,000 candidates.
//
// Engine cases (engine-dtr, engine-dtr-frag; --engine-decisions D, default 2,000): the whole
// decision in a real eviction_engine on the simulated device, not the policy alone. The engine
// holds an unrolled chain x_i = f(x_{i-1}, w) of buffers of 64 KiB sharing one weight w (the
// shape of spillway-evict-sim's synth:mlp:...,shared=1), one in ten dropped, so that a fifth of
// the candidates have dropped neighbours and a neighbourhood cost: N + D candidates. The segments
// are then filled and the budget set to what is reserved, so that each of D allocations of 64 KiB
// makes the pressure handler decide once and evict one buffer (the allocations are kept, so the
// candidates fall from N + D to N: every decision sees at least N). A decision's
// time is the growth of engine_stats::decision_time_ns across it: the policy's choose() with the
// engine's candidate_view describing every sampled candidate. Between decisions the tool reads
// engine_stats, which walks every buffer record, as a training step's other work would: the
// sampled candidate records are not in the cache when a decision starts. An allocation that made
// several decisions counts each at their mean (none is left out). A case that measured no decision
// fails the tool (so does --smoke, which ctest runs): a 0 ns median is no figure.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench_common.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/eviction/engine.hpp"
#include "spillway/eviction/policy.hpp"
#include "spillway/sim_device.hpp"

namespace spillway::bench {
namespace {

using eviction::buffer_id;
using eviction::candidate_info;
using eviction::eviction_request;

constexpr double k_target_ns = 5000;
constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr stream_ref k_compute_stream{1};

class synthetic_view final : public eviction::candidate_view {
 public:
  synthetic_view(std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> log_size(16, 28);  // 64 KiB .. 256 MiB
    std::uniform_real_distribution<double> unit(0, 1);
    std::uniform_real_distribution<double> log_stale(3, 10);  // 1 us .. 10 s
    std::uniform_real_distribution<double> log_cost(3, 7);    // 1 us .. 10 ms
    auto key = [&] {
      std::uint64_t k = 0;
      while (k == 0 || registry_.count(k) != 0 || ranges_.count(k) != 0) k = rng();
      return k;
    };
    items_.reserve(n);
    registry_.reserve(n);
    ranges_.reserve(5 * n);
    for (std::size_t i = 0; i < n; ++i) {
      candidate_info c;
      c.id = buffer_id{key()};
      c.size = static_cast<std::size_t>(std::exp2(log_size(rng)));
      c.stream = unit(rng) < 0.9 ? k_compute_stream : stream_ref{2};
      c.small_pool = c.size <= k_mib;
      c.staleness_ns = std::pow(10.0, log_stale(rng));
      c.cost_ns = std::pow(10.0, log_cost(rng));
      c.neighbourhood_cost_ns = unit(rng) < 0.2 ? std::pow(10.0, log_cost(rng)) : 0;
      // Its block, plus free neighbours half of the time.
      const double neighbours = unit(rng) < 0.5 ? unit(rng) * 2 : 0;
      const std::uint64_t block = key();
      registry_.emplace(c.id.value, block);
      ranges_.emplace(block, c.size + static_cast<std::size_t>(c.size * neighbours));
      items_.push_back(c);
    }
    for (std::size_t i = 0; i < 4 * n; ++i) ranges_.emplace(key(), k_mib);  // other blocks
    // The 16 cheapest per byte (the policies ask for 8), as the engine's cached prefix of its
    // cost order hands them out.
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    const auto per_byte = [&](std::size_t i) {
      return (items_[i].cost_ns + items_[i].neighbourhood_cost_ns) / static_cast<double>(items_[i].size);
    };
    const std::size_t front = std::min<std::size_t>(16, n);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(front), order.end(),
                      [&](std::size_t a, std::size_t b) { return per_byte(a) < per_byte(b); });
    cheapest_.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(front));
    lru_ = items_.front();
    largest_ = *std::max_element(items_.begin(), items_.end(),
                                 [](const candidate_info& a, const candidate_info& b) { return a.size < b.size; });
  }

  std::size_t count() const override { return items_.size(); }
  candidate_info at(std::size_t index) const override {
    ++at_calls;
    return items_[index];
  }
  std::optional<candidate_info> least_recently_used() const override { return lru_; }
  std::size_t cheapest_per_byte(std::span<std::size_t> out) const override {
    const std::size_t k = std::min(out.size(), cheapest_.size());
    std::copy_n(cheapest_.begin(), k, out.begin());
    return k;
  }
  std::optional<candidate_info> largest() const override { return largest_; }
  std::size_t contiguous_if_evicted(buffer_id id) const override {
    ++lookups;
    auto entry = registry_.find(id.value);
    if (entry == registry_.end()) return 0;
    std::lock_guard lock(allocator_mutex_);
    auto it = ranges_.find(entry->second);
    return it == ranges_.end() ? 0 : it->second;
  }
  // The modelled heap has fixed segments and its requests are contiguous, so dtr-frag never asks
  // (it does only for expandable segments); whole segments are described by the candidates.
  std::size_t releasable_if_evicted(buffer_id) const override { return 0; }

  const std::vector<candidate_info>& items() const { return items_; }
  mutable std::uint64_t at_calls = 0;
  mutable std::uint64_t lookups = 0;

 private:
  std::vector<candidate_info> items_;
  std::unordered_map<std::uint64_t, std::uint64_t> registry_;  // id -> block address
  mutable std::mutex allocator_mutex_;
  std::unordered_map<std::uint64_t, std::size_t> ranges_;      // block address -> range
  std::optional<candidate_info> lru_;
  std::optional<candidate_info> largest_;
  std::vector<std::size_t> cheapest_;
};

struct case_spec {
  std::string name;
  std::string policy;
  eviction_request request;
};

struct case_result {
  std::string name;
  std::string policy;
  double median_ns = 0, p10_ns = 0, p90_ns = 0, p99_ns = 0, mean_ns = 0;
  double at_per_call = 0, lookups_per_call = 0;
  std::uint64_t calls = 0;
  bool engine = false;                       // an engine case: candidates counted, no view calls
  std::size_t candidates_first = 0, candidates_last = 0;
};

// Median and tail of per-call times (sorts `ns`; it must not be empty).
void set_percentiles(case_result& r, std::vector<double>& ns) {
  std::sort(ns.begin(), ns.end());
  const auto at = [&](double q) {
    return ns[static_cast<std::size_t>(q * static_cast<double>(ns.size() - 1) + 0.5)];
  };
  r.median_ns = at(0.5);
  r.p10_ns = at(0.1);
  r.p90_ns = at(0.9);
  r.p99_ns = at(0.99);
}

using steady = std::chrono::steady_clock;

double ns_between(steady::time_point a, steady::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

case_result run_case(const case_spec& spec, synthetic_view& view, std::size_t calls, std::uint64_t seed) {
  auto policy = eviction::make_policy(spec.policy, seed);
  volatile std::uint64_t sink = 0;  // keeps the calls observable
  for (int i = 0; i < 1000; ++i) sink = sink + policy->choose(view, spec.request).value_or(buffer_id{}).value;
  view.at_calls = 0;
  view.lookups = 0;
  std::vector<double> ns(calls);
  const auto start = steady::now();
  for (std::size_t i = 0; i < calls; ++i) {
    const auto t0 = steady::now();
    const std::optional<buffer_id> victim = policy->choose(view, spec.request);
    const auto t1 = steady::now();
    sink = sink + victim.value_or(buffer_id{}).value;
    ns[i] = ns_between(t0, t1);
  }
  const auto end = steady::now();

  case_result r;
  r.name = spec.name;
  r.policy = spec.policy;
  r.calls = calls;
  r.mean_ns = ns_between(start, end) / static_cast<double>(calls);
  r.at_per_call = static_cast<double>(view.at_calls) / static_cast<double>(calls);
  r.lookups_per_call = static_cast<double>(view.lookups) / static_cast<double>(calls);
  set_percentiles(r, ns);
  return r;
}

// ns per contiguous_if_evicted call on random candidates: independent calls (throughput, the
// CPU overlaps their cache misses) ...
double lookup_ns(synthetic_view& view, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  constexpr int n = 200'000;
  std::vector<buffer_id> ids(n);
  for (buffer_id& id : ids) id = view.items()[rng() % view.items().size()].id;
  volatile std::size_t sink = 0;
  const auto t0 = steady::now();
  for (const buffer_id id : ids) sink = sink + view.contiguous_if_evicted(id);
  const auto t1 = steady::now();
  return ns_between(t0, t1) / n;
}

// ... and a chain in which each call's id depends on the previous answer (latency).
double lookup_latency_ns(synthetic_view& view) {
  constexpr int n = 200'000;
  const std::size_t count = view.items().size();
  std::size_t index = 0;
  const auto t0 = steady::now();
  for (int i = 0; i < n; ++i) {
    const std::size_t range = view.contiguous_if_evicted(view.items()[index].id);
    index = (index * 7919 + range + 1) % count;
  }
  const auto t1 = steady::now();
  volatile std::size_t sink = index;
  (void)sink;
  return ns_between(t0, t1) / n;
}

// The engine cases: see the top of the file.
case_result run_engine_case(const std::string& name, const std::string& policy, std::size_t candidates,
                            std::size_t decisions, std::uint64_t seed) {
  constexpr std::size_t k_bytes = 64 * 1024;
  // One in ten is dropped: enough buffers that the last decision still sees `candidates`.
  const std::size_t n = (candidates + decisions) * 10 / 9 + 2;
  auto sim = std::make_shared<sim_device>(sim_config{});
  const stream_ref stream = sim->create_stream();
  case_result r;
  {
    device_allocator alloc(sim, allocator_config{});
    eviction::engine_config ec;
    ec.policy = policy;
    ec.seed = seed;
    ec.allow_spill = false;
    ec.clock = [s = sim.get()] { return s->now_ns(); };
    eviction::eviction_engine engine(alloc, ec);
    const auto kernel = [s = sim.get()](std::span<void* const>, std::span<void* const>, stream_ref st) {
      s->launch(st, 1000);
    };
    eviction::buffer_options weight_options;
    weight_options.evictable = false;
    const eviction::buffer_id w = engine.register_buffer(alloc.allocate(k_bytes, stream), k_bytes, stream, weight_options);
    std::vector<eviction::buffer_id> x{engine.register_buffer(alloc.allocate(k_bytes, stream), k_bytes, stream)};
    for (std::size_t i = 1; i < n; ++i) {
      sim->advance(1000);  // staleness grows along the chain
      const double cost = 1000.0 + static_cast<double>((i * 7919) % 5000);
      std::string op = "f";
      op += std::to_string(i);
      const eviction::node_id node = engine.add_node({std::move(op), {x.back(), w}, 1, kernel, cost});
      eviction::buffer_options o;
      o.producer = node;
      x.push_back(engine.register_buffer(alloc.allocate(k_bytes, stream), k_bytes, stream, o));
    }
    for (std::size_t i = 5; i < n; i += 10) engine.evict(x[i], eviction::eviction_mode::drop);
    sim->run_until_idle();
    // No slack: fill the holes the drops left and the rest of the last segment, then cap reserved
    // bytes at what is reserved (the segment that the last allocation opened is given back).
    std::vector<void*> held;
    const auto reserved = [&] { return static_cast<std::size_t>(alloc.stats().reserved_bytes[0].current); };
    for (;;) {
      const std::size_t before = reserved();
      void* p = alloc.allocate(k_bytes, stream);
      if (reserved() == before) {
        held.push_back(p);
        continue;
      }
      alloc.deallocate(p);
      alloc.set_budget(before);
      break;
    }

    const auto count_candidates = [&] {
      std::size_t count = 0;
      for (eviction::buffer_id id : x) count += engine.describe_candidate(id).has_value() ? 1 : 0;
      return count;
    };
    r.candidates_first = count_candidates();
    std::vector<double> ns;
    ns.reserve(decisions);
    double seen = engine.stats().decision_time_ns;
    std::uint64_t made = engine.stats().decisions;
    for (std::size_t d = 0; d < decisions; ++d) {
      held.push_back(alloc.allocate(k_bytes, stream));  // one decision, one eviction, mostly
      const eviction::engine_stats st = engine.stats();
      // An allocation that made several decisions (a victim skipped, then another chosen) counts
      // each at their mean: none is left out, the slower ones included.
      const std::uint64_t made_now = st.decisions - made;
      for (std::uint64_t k = 0; k < made_now; ++k) {
        ns.push_back((st.decision_time_ns - seen) / static_cast<double>(made_now));
      }
      seen = st.decision_time_ns;
      made = st.decisions;
    }
    r.candidates_last = count_candidates() + 1;  // before the last decision's eviction
    sim->run_until_idle();
    for (void* p : held) alloc.deallocate(p);
    r.name = name;
    r.policy = policy;
    r.engine = true;
    r.calls = ns.size();
    if (!ns.empty()) {
      r.mean_ns = std::accumulate(ns.begin(), ns.end(), 0.0) / static_cast<double>(ns.size());
      set_percentiles(r, ns);
    }
  }
  sim->destroy_stream(stream);
  return r;
}

std::string fmt_double(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", v);
  return text;
}

double clock_pair_ns() {
  constexpr int n = 100'000;
  double total = 0;
  for (int i = 0; i < n; ++i) {
    const auto a = steady::now();
    const auto b = steady::now();
    total += ns_between(a, b);
  }
  return total / n;
}

// The target is met by a median measured on some decisions: a case with none meets nothing.
bool meets(const case_result& r) { return r.calls > 0 && r.median_ns <= k_target_ns; }

// Every case measured something (else the tool fails: a figure of 0 ns is no figure).
bool sampled(const std::vector<case_result>& results) {
  bool all = true;
  for (const case_result& r : results) {
    if (r.calls == 0 || !(r.median_ns > 0)) {
      std::fprintf(stderr, "spillway-policy-bench: case %s measured no decision\n", r.name.c_str());
      all = false;
    }
  }
  return all;
}

int run(int argc, char** argv) {
  arg_parser args(argc, argv);
  if (args.flag("help")) {
    std::puts("usage: spillway-policy-bench [--candidates N] [--calls CALLS] [--seed S] [--case NAME] [--json]\n"
              "                             [--smoke]");
    return 0;
  }
  const bool smoke = args.flag("smoke");
  const long long candidates = args.get_int("candidates", 10'000);
  const long long calls = args.get_int("calls", smoke ? 500 : 200'000);
  const long long engine_decisions = args.get_int("engine-decisions", smoke ? 50 : 2'000);
  const auto seed = static_cast<std::uint64_t>(args.get_int("seed", 1));
  const std::string only = args.get("case", "");
  const bool json = args.flag("json");
  args.finish();
  if (candidates < 1 || calls < 1 || engine_decisions < 1) {
    throw invalid_argument("--candidates, --calls and --engine-decisions must be >= 1");
  }
  const std::vector<std::string> case_names = {"dtr", "lru", "largest", "dtr-frag", "dtr-frag-nofit",
                                               "engine-dtr", "engine-dtr-frag"};
  if (!only.empty() && std::find(case_names.begin(), case_names.end(), only) == case_names.end()) {
    throw invalid_argument("unknown --case \"" + only +
                           "\"; expected dtr, lru, largest, dtr-frag, dtr-frag-nofit, engine-dtr or engine-dtr-frag");
  }

  synthetic_view view(static_cast<std::size_t>(candidates), seed);
  const double lookup = lookup_ns(view, seed + 1);
  const double lookup_latency = lookup_latency_ns(view);
  const double clock_ns = clock_pair_ns();

  eviction_request shortfall;  // bytes 0: just free bytes
  shortfall.shortfall = 64 * k_mib;
  eviction_request fits;
  fits.stream = k_compute_stream;
  fits.bytes = 32 * k_mib;
  fits.shortfall = 32 * k_mib;
  eviction_request nofit = fits;
  nofit.bytes = std::size_t{1} << 40;  // 1 TiB: nothing fits
  const std::vector<case_spec> specs = {
      {"dtr", "dtr", shortfall},
      {"lru", "lru", shortfall},
      {"largest", "largest", shortfall},
      {"dtr-frag", "dtr-frag", fits},
      {"dtr-frag-nofit", "dtr-frag", nofit},
  };
  std::vector<case_result> results;
  for (const case_spec& spec : specs) {
    if (!only.empty() && spec.name != only) continue;
    results.push_back(run_case(spec, view, static_cast<std::size_t>(calls), seed));
  }
  for (const char* policy : {"dtr", "dtr-frag"}) {
    std::string name = "engine-";
    name += policy;
    if (!only.empty() && name != only) continue;
    results.push_back(run_engine_case(name, policy, static_cast<std::size_t>(candidates),
                                      static_cast<std::size_t>(engine_decisions), seed));
  }

  if (json) {
    json_writer j(std::cout);
    j.begin_object();
    j.field("tool", "spillway-policy-bench");
    j.field("candidates", static_cast<std::int64_t>(candidates));
    j.field("calls", static_cast<std::int64_t>(calls));
    j.field("lookup_ns", lookup).field("lookup_latency_ns", lookup_latency);
    j.field("clock_pair_ns", clock_ns).field("target_ns", k_target_ns);
    j.key("results").begin_array();
    for (const case_result& r : results) {
      j.begin_object();
      j.field("case", r.name).field("policy", r.policy);
      j.field("median_ns", r.median_ns).field("p10_ns", r.p10_ns).field("p90_ns", r.p90_ns);
      j.field("p99_ns", r.p99_ns).field("mean_ns", r.mean_ns);
      if (r.engine) {
        j.field("candidates_first", static_cast<std::uint64_t>(r.candidates_first));
        j.field("candidates_last", static_cast<std::uint64_t>(r.candidates_last));
      } else {
        j.field("at_per_call", r.at_per_call).field("lookups_per_call", r.lookups_per_call);
      }
      j.field("samples", r.calls).field("meets_target", meets(r));
      j.end_object();
    }
    j.end_array();
    j.end_object();
    std::cout << '\n';
    return sampled(results) ? 0 : 1;
  }
  std::printf("spillway-policy-bench: ns per choose() over %lld candidates, %lld calls per case\n",
              candidates, calls);
  std::printf("  contiguous_if_evicted: %.1f ns per independent lookup, %.1f ns per dependent one;"
              " steady_clock::now() pair: %.1f ns (included)\n\n",
              lookup, lookup_latency, clock_ns);
  std::printf("  %-16s %-9s %10s %10s %10s %10s %10s %8s %8s  %s\n", "case", "policy", "median ns",
              "p10 ns", "p90 ns", "p99 ns", "mean ns", "at()", "lookups", "target <= 5 us");
  for (const case_result& r : results) {
    const std::string at = r.engine ? "-" : fmt_double(r.at_per_call);
    const std::string lookups = r.engine ? "-" : fmt_double(r.lookups_per_call);
    std::printf("  %-16s %-9s %10.1f %10.1f %10.1f %10.1f %10.1f %8s %8s  %s\n", r.name.c_str(),
                r.policy.c_str(), r.median_ns, r.p10_ns, r.p90_ns, r.p99_ns, r.mean_ns, at.c_str(),
                lookups.c_str(), r.calls == 0 ? "NO SAMPLES" : meets(r) ? "met" : "MISSED");
  }
  for (const case_result& r : results) {
    if (!r.engine) continue;
    std::printf("  %s: %llu decisions by a real engine (sim device), %zu candidates at the first, %zu at the last\n",
                r.name.c_str(), static_cast<unsigned long long>(r.calls), r.candidates_first, r.candidates_last);
  }
  return sampled(results) ? 0 : 1;
}

}  // namespace
}  // namespace spillway::bench

int main(int argc, char** argv) {
  return spillway::bench::run_tool("spillway-policy-bench", spillway::bench::run, argc, argv);
}
