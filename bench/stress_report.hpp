// stress_report: what spillway-stress prints at the end, as a table or as one JSON object.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "spillway/stats.hpp"
#include "stress_run.hpp"

namespace spillway::bench {

struct stress_report {
  // The setup.
  std::string device_kind;   // "sim" or "cuda"
  std::string device_name;   // the backend's name()
  std::string device_why;    // why this device (make_backend's reason)
  std::string work;          // what the device work and checks were
  int threads = 0;
  std::size_t streams = 0;
  double seconds = 0;        // requested (0 with ops)
  std::uint64_t ops = 0;     // requested (0 with seconds)
  std::size_t budget = 0;
  std::size_t max_size = 0;
  std::uint64_t seed = 0;
  bool expandable = false;
  double lifetime_scale = 1;  // stress_run's scaling of lifetimes to the budget

  // The outcome.
  double elapsed_s = 0;
  stress_counts counts;
  std::uint64_t async_checks = 0;
  std::uint64_t async_corruptions = 0;
  std::uint64_t kernels = 0;
  latency_summary latency;
  memory_stats stats;            // after every free, before empty_cache (peaks are the run's)
  memory_stats after_release;    // after empty_cache
  std::uint64_t warnings = 0;    // messages the allocator sent to on_warning
  std::string error;             // an unexpected exception in a worker
  std::vector<std::string> failures;

  double ops_per_second() const noexcept { return elapsed_s > 0 ? counts.ops / elapsed_s : 0; }
  // Peak reserved / peak allocated: what the cache held per byte in use at the worst moment.
  double fragmentation() const noexcept;
  std::uint64_t corruptions() const noexcept { return counts.corruptions + async_corruptions; }
  bool passed() const noexcept { return failures.empty(); }
};

// Fills report.failures from the outcome: corruption, bad frees, a worker error, allocated or
// active bytes left after every free, reserved bytes left after empty_cache.
void judge(stress_report& report);

void print_table(std::ostream& out, const stress_report& report);
void print_json(std::ostream& out, const stress_report& report);

}  // namespace spillway::bench
