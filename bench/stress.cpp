// spillway-stress: many threads and streams allocate, free and record_stream at random against a
// budget, check every allocation's data, and report throughput, latency, OOMs and fragmentation.
//
//   spillway-stress [--device auto|sim|cuda] [--threads 8] [--streams 4] [--seconds 10 | --ops N]
//                   [--budget BYTES] [--max-size BYTES] [--seed 1] [--expandable] [--json]
//                   [--smoke] [--progress | --no-progress]
//
// --device auto runs on the GPU when there is one, else on the simulated device (16 GiB, realtime
// clock). The default budget is 60% of the simulated device, or of the GPU's free memory. --smoke is
// a ~1 s run with 4 threads, 2 streams and a 256 MiB budget, for ctest.
//
// Exit status: 0 when every check passed; 1 on corruption, a refused free, a worker error,
// allocator statistics that do not return to zero after every free, or a peak reserved over the
// budget; 2 on bad arguments.
// The workload is described in stress_run.hpp, the checks in stress_work.hpp.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <thread>

#include "bench_common.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "stress_report.hpp"
#include "stress_run.hpp"
#include "stress_work.hpp"

namespace spillway::bench {
namespace {

constexpr int agg = static_cast<int>(stat_type::aggregate);
constexpr std::size_t mib = std::size_t{1} << 20;

void print_usage() {
  std::fputs(
      "usage: spillway-stress [--device auto|sim|cuda] [--threads N] [--streams N]\n"
      "                       [--seconds S | --ops N] [--budget BYTES] [--max-size BYTES]\n"
      "                       [--seed N] [--expandable] [--json] [--smoke]\n"
      "                       [--progress | --no-progress]\n"
      "  --device      auto (default): the GPU if there is one, else the simulated device\n"
      "  --threads     worker threads (default 8; --smoke 4)\n"
      "  --streams     streams the workers allocate on (default 4; --smoke 2)\n"
      "  --seconds     run time (default 10; --smoke 1)\n"
      "  --ops         run about N allocations + frees instead (the final frees come on top)\n"
      "  --budget      reserved-bytes cap, e.g. 2GiB (default 60% of the device; --smoke 256MiB)\n"
      "  --max-size    largest request (default min(1GiB, budget/8); --smoke 32MiB)\n"
      "  --expandable  expandable segments (VMM)\n"
      "  --json        print the summary as one JSON object on stdout\n"
      "  --progress    a live status line on stderr (default: only when stderr is a terminal)\n",
      stdout);
}

// One status line on stderr, redrawn in place.
class progress_line {
 public:
  explicit progress_line(bool enabled) : enabled_(enabled) {}
  ~progress_line() { finish(); }

  void update(double elapsed_s, std::uint64_t ops, const memory_stats& s, std::uint64_t ooms) {
    if (!enabled_) return;
    const double dt = elapsed_s - last_s_;
    const double rate = dt > 0 ? static_cast<double>(ops - last_ops_) / dt : 0;
    last_s_ = elapsed_s;
    last_ops_ = ops;
    std::fprintf(stderr, "\r[%6.1f s] %9.0f ops/s  live %10s  reserved %10s  OOMs %-8llu",
                 elapsed_s, rate,
                 format_bytes(static_cast<std::size_t>(s.allocated_bytes[agg].current)).c_str(),
                 format_bytes(static_cast<std::size_t>(s.reserved_bytes[agg].current)).c_str(),
                 static_cast<unsigned long long>(ooms));
    std::fflush(stderr);
    drawn_ = true;
  }
  void finish() {
    if (drawn_) std::fputc('\n', stderr);
    drawn_ = false;
  }

 private:
  bool enabled_;
  bool drawn_ = false;
  double last_s_ = 0;
  std::uint64_t last_ops_ = 0;
};

int run(int argc, char** argv) {
  arg_parser args(argc, argv);
  if (args.flag("help")) {
    print_usage();
    return 0;
  }
  const bool smoke = args.flag("smoke");
  const std::string device = args.get("device", "auto");
  const auto threads = static_cast<int>(args.get_int("threads", smoke ? 4 : 8));
  const auto stream_count = static_cast<int>(args.get_int("streams", smoke ? 2 : 4));
  const double seconds = args.get_double("seconds", smoke ? 1.0 : 10.0);
  const auto ops = static_cast<std::uint64_t>(args.get_int("ops", 0));
  const std::size_t budget_arg = args.get_bytes("budget", smoke ? 256 * mib : 0);
  const std::size_t max_size_arg = args.get_bytes("max-size", smoke ? 32 * mib : 0);
  const auto seed = static_cast<std::uint64_t>(args.get_int("seed", 1));
  const bool expandable = args.flag("expandable");
  const bool json = args.flag("json");
  const bool progress_on = args.flag("progress");
  const bool progress_off = args.flag("no-progress");
  args.finish();
  if (threads < 1 || stream_count < 1) {
    throw invalid_argument("spillway-stress: --threads and --streams must be at least 1");
  }
  if (ops == 0 && !(seconds > 0)) {
    throw invalid_argument("spillway-stress: --seconds must be positive (or give --ops)");
  }

  sim_config sim;
  sim.clock = clock_mode::realtime;  // stream work completes by itself, as on a GPU
  if (device != "auto" && device != "sim" && device != "cuda") {
    throw invalid_argument("spillway-stress: unknown --device \"" + device + "\": expected auto, sim or cuda");
  }
  backend_choice choice;
  try {
    choice = make_backend(device, 0, sim);
  } catch (const std::exception& e) {  // e.g. --device cuda without a usable GPU
    throw device_error("cannot use --device " + device + ": " + e.what());
  }
  device_backend& backend = *choice.backend;

  stress_report report;
  report.device_kind = choice.kind;
  report.device_name = backend.name();
  report.device_why = choice.why;
  report.threads = threads;
  report.streams = static_cast<std::size_t>(stream_count);
  report.seconds = ops > 0 ? 0 : seconds;
  report.ops = ops;
  report.seed = seed;
  report.expandable = expandable;
  const std::size_t room = choice.kind == "sim" ? backend.total_memory() : backend.free_memory();
  report.budget = budget_arg != 0 ? budget_arg : room / 10 * 6;
  report.max_size = max_size_arg != 0 ? max_size_arg : std::min<std::size_t>(1024 * mib, report.budget / 8);
  if (report.max_size < 64) throw invalid_argument("spillway-stress: --max-size must be at least 64 bytes");
  std::fprintf(stderr, "spillway-stress: running on %s: %s\n", report.device_name.c_str(),
               report.device_why.c_str());

  std::atomic<std::uint64_t> warnings{0};
  std::mutex warn_mutex;
  allocator_config config;
  config.budget = report.budget;
  config.expandable_segments = expandable;
  config.on_warning = [&](const std::string& message) {
    if (warnings.fetch_add(1) < 5) {
      std::lock_guard lock(warn_mutex);
      std::fprintf(stderr, "\n%s\n", message.c_str());
    }
  };

  std::vector<stream_ref> streams;
  for (int i = 0; i < stream_count; ++i) streams.push_back(backend.create_stream());
  std::unique_ptr<stress_work> work;
  if (choice.sim) {
    work = make_sim_work(choice.sim, threads);
  } else {
#ifdef SPILLWAY_WITH_CUDA
    work = make_cuda_work(backend.device_index(), threads);
#else
    throw invalid_argument("spillway-stress: this build has no CUDA support");
#endif
  }
  report.work = work->describe();

  {
    device_allocator allocator(choice.backend, config);
    stress_options options;
    options.threads = threads;
    options.streams = streams;
    options.seconds = seconds;
    options.ops = ops;
    options.max_size = report.max_size;
    options.seed = seed;
    options.budget = report.budget;
    stress_run run(allocator, *work, options);

    progress_line progress(!progress_off && (progress_on || isatty(STDERR_FILENO)));
    const auto start = std::chrono::steady_clock::now();
    const auto elapsed = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    run.start();
    for (int tick = 1; !run.finished(); ++tick) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (ops == 0 && elapsed() >= seconds) run.stop();
      if (tick % 5 == 0) {  // 4 redraws a second
        const stress_counts now = run.counts();
        progress.update(elapsed(), now.ops, allocator.stats(), now.ooms);
      }
    }
    run.join();
    report.elapsed_s = elapsed();
    report.lifetime_scale = run.lifetime_scale();
    progress.finish();

    work->drain();  // every kernel effect has run: the async checks are final
    report.counts = run.counts();
    report.latency = run.latency();
    report.error = run.error();
    report.async_checks = work->async_checks();
    report.async_corruptions = work->async_corruptions();
    report.kernels = work->kernels();
    report.stats = allocator.stats();
    allocator.empty_cache();
    report.after_release = allocator.stats();
  }
  work.reset();
  for (stream_ref s : streams) backend.destroy_stream(s);
  report.warnings = warnings.load();

  judge(report);
  if (json) {
    print_json(std::cout, report);
  } else {
    print_table(std::cout, report);
  }
  return report.passed() ? 0 : 1;
}

}  // namespace
}  // namespace spillway::bench

int main(int argc, char** argv) {
  return spillway::bench::run_tool("spillway-stress", spillway::bench::run, argc, argv);
}
