// spillway-alloc-bench: the median cost of an alloc+free pair on spillway's paths, and on the GPU
// the same cases for cudaMalloc, cudaMallocAsync and CUB's caching allocator in the same run.
//
//   spillway-alloc-bench [--device auto|sim|cuda] [--iterations BATCHES] [--batch PAIRS]
//                        [--threads N] [--json] [--smoke]
//
// Each case is timed in batches of up to --batch pairs (default 1000; fewer when a pair is slow,
// so a batch takes ~100 us) after a warm-up, with steady_clock; the figures are the median, p10
// and p90 of the per-pair time over --iterations batches (default 200). The cases are described
// in alloc_bench_cases.hpp, the peers in alloc_peers.hpp. On the simulated device the numbers are
// the allocator's CPU cost alone (the simulator's calls are cheap and take no device time).
// --smoke: 5 batches of at most 100 pairs, for ctest.
#include <cstdio>
#include <iostream>
#include <memory>
#include <thread>

#include "alloc_bench_cases.hpp"
#include "alloc_peers.hpp"
#include "bench_common.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"

namespace spillway::bench {
namespace {

class spillway_subject {
 public:
  explicit spillway_subject(std::shared_ptr<device_backend> backend)
      : allocator_(std::move(backend)) {}
  ~spillway_subject() {  // frees still waiting on events are reaped, not reported as leaks
    try {
      allocator_.backend().synchronize_device();
      allocator_.empty_cache();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "spillway-alloc-bench: cleanup: %s\n", e.what());
    }
  }
  spillway_subject(const spillway_subject&) = delete;
  spillway_subject& operator=(const spillway_subject&) = delete;
  std::string name() const { return "spillway"; }
  void thread_init() {}
  void* allocate(std::size_t bytes, stream_ref s) { return allocator_.allocate(bytes, s); }
  void deallocate(void* p, stream_ref) { allocator_.deallocate(p); }
  void deallocate_after(void* p, stream_ref, stream_ref other) {
    allocator_.record_stream(p, other);
    allocator_.deallocate(p);
  }
  device_allocator& allocator() { return allocator_; }

 private:
  device_allocator allocator_;
};

// Every case on a fresh allocator, so that no case sees another's cache.
std::vector<case_result> run_spillway(const std::shared_ptr<device_backend>& backend, stream_ref s1,
                                      stream_ref s2, const std::vector<stream_ref>& per_thread,
                                      const timing& t) {
  std::vector<case_result> results;
  {
    spillway_subject a(backend);
    results.push_back(cache_hit_case(a, s1, t));
  }
  {
    spillway_subject a(backend);
    results.push_back(split_case(a, s1, t));
  }
  {
    spillway_subject a(backend);
    results.push_back(cross_stream_case(a, s1, s2, t));
    // Every reap should have found its events complete: one segment, reused throughout.
    const memory_stats s = a.allocator().stats();
    if (s.num_device_alloc > 1) {
      std::fprintf(stderr, "spillway-alloc-bench: note: cross_stream reserved %lld segments (events "
                   "were not complete when the segment ran out)\n",
                   static_cast<long long>(s.num_device_alloc));
    }
  }
  {
    spillway_subject a(backend);
    results.push_back(multi_thread_case(a, per_thread, t));
  }
  return results;
}

void print_table(const std::vector<case_result>& results, const std::string& device) {
  std::printf("spillway-alloc-bench on %s: ns per alloc+free pair\n\n", device.c_str());
  std::printf("  %-14s %-28s %8s %10s %10s %10s %10s %12s\n", "case", "allocator", "threads",
              "median ns", "p10 ns", "p90 ns", "mean ns", "pairs");
  for (const case_result& r : results) {
    std::printf("  %-14s %-28s %8d %10.1f %10.1f %10.1f %10.1f %12llu\n", r.name.c_str(),
                r.allocator.c_str(), r.threads, r.median_ns, r.p10_ns, r.p90_ns, r.mean_ns,
                static_cast<unsigned long long>(r.iterations));
  }
  std::puts("\n  median/p10/p90: over batches (of every thread); mean: time of the timed phase x threads"
            " / pairs");
}

void print_json(const std::vector<case_result>& results, const backend_choice& choice,
                const timing& t) {
  json_writer j(std::cout);
  j.begin_object();
  j.field("tool", "spillway-alloc-bench");
  j.field("device", choice.kind).field("device_name", choice.backend->name());
  j.field("device_why", choice.why);
  j.field("bytes", static_cast<std::uint64_t>(bench_bytes));
  j.field("batches", t.batches).field("max_pairs_per_batch", t.pairs_per_batch);
  j.key("results").begin_array();
  for (const case_result& r : results) {
    j.begin_object();
    j.field("case", r.name).field("allocator", r.allocator);
    j.field("median_ns", r.median_ns).field("p10", r.p10_ns).field("p90", r.p90_ns);
    j.field("mean_ns", r.mean_ns);
    j.field("iterations", r.iterations).field("threads", r.threads);
    j.end_object();
  }
  j.end_array();
  j.end_object();
  std::cout << '\n';
}

int run(int argc, char** argv) {
  arg_parser args(argc, argv);
  if (args.flag("help")) {
    std::puts("usage: spillway-alloc-bench [--device auto|sim|cuda] [--iterations BATCHES]\n"
              "                            [--batch PAIRS] [--threads N] [--json] [--smoke]");
    return 0;
  }
  const bool smoke = args.flag("smoke");
  const std::string device = args.get("device", "auto");
  timing t;
  t.batches = static_cast<int>(args.get_int("iterations", smoke ? 5 : 200));
  t.pairs_per_batch = static_cast<int>(args.get_int("batch", smoke ? 100 : 1000));
  const auto hw = static_cast<int>(std::thread::hardware_concurrency());
  const auto threads = static_cast<int>(args.get_int("threads", std::max(2, hw)));
  const bool json = args.flag("json");
  args.finish();
  if (t.batches < 1 || t.pairs_per_batch < 1 || threads < 1) {
    throw invalid_argument("spillway-alloc-bench: --iterations, --batch and --threads must be >= 1");
  }

  if (device != "auto" && device != "sim" && device != "cuda") {
    throw invalid_argument("spillway-alloc-bench: unknown --device \"" + device + "\": expected auto, sim or cuda");
  }
  backend_choice choice;
  try {
    choice = make_backend(device, 0, sim_config{});
  } catch (const std::exception& e) {  // e.g. --device cuda without a usable GPU
    throw device_error("cannot use --device " + device + ": " + e.what());
  }
  device_backend& backend = *choice.backend;
  std::fprintf(stderr, "spillway-alloc-bench: running on %s: %s\n", backend.name().c_str(),
               choice.why.c_str());
  const stream_ref s1 = backend.create_stream();
  const stream_ref s2 = backend.create_stream();
  std::vector<stream_ref> per_thread;
  for (int i = 0; i < threads; ++i) per_thread.push_back(backend.create_stream());

  std::vector<case_result> results = run_spillway(choice.backend, s1, s2, per_thread, t);
#ifdef SPILLWAY_WITH_CUDA
  if (choice.kind == "cuda") {
    std::vector<case_result> peers = run_cuda_peers(backend.device_index(), s1, s2, per_thread, t);
    results.insert(results.end(), peers.begin(), peers.end());
  }
#endif

  backend.synchronize_device();
  for (stream_ref s : per_thread) backend.destroy_stream(s);
  backend.destroy_stream(s2);
  backend.destroy_stream(s1);

  if (json) {
    print_json(results, choice, t);
  } else {
    print_table(results, backend.name());
  }
  return 0;
}

}  // namespace
}  // namespace spillway::bench

int main(int argc, char** argv) {
  return spillway::bench::run_tool("spillway-alloc-bench", spillway::bench::run, argc, argv);
}
