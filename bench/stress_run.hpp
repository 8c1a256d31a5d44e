// stress_run: the worker threads of spillway-stress and what they count.
//
// Each worker loops: adopt allocations other threads handed it, free what is due, else allocate.
//   sizes      75% small (512 B - 1 MiB), 22% medium (1 - 32 MiB), 3% large (32 MiB - max_size),
//              log-uniform within each class, at byte granularity (most are not 512-multiples)
//   lifetimes  counted in the worker's own loop turns: short (0-8), medium (8-256), long
//              (256-4096); small blocks are held longest, large ones are mostly short-lived. All
//              are scaled so that the expected live bytes are half the budget (lifetime_scale()):
//              the peaks and fragmentation then reach it, as in a job sized to its memory
//   streams    each allocation on a random stream of the run
//   8%         handed to another thread, which frees it (cross-thread free)
//   12%        record_stream'ed onto another stream, with stream work there that uses the block
//   1%         background stream work on a random stream, so events complete later
// Every allocation is filled with its pattern and verified before its free (stress_work).
// out_of_memory is an expected event: counted, and the worker frees its next-due allocation.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "spillway/device_allocator.hpp"
#include "stress_work.hpp"

namespace spillway::bench {

struct stress_options {
  int threads = 8;
  std::vector<stream_ref> streams;  // at least one
  double seconds = 10.0;            // ignored when ops > 0
  std::uint64_t ops = 0;            // total over all threads; 0: run for `seconds`
  std::size_t max_size = std::size_t{1} << 30;
  std::uint64_t seed = 1;
  std::size_t budget = 0;           // lifetimes are scaled so that the expected live bytes are
  double fill = 0.5;                // `fill` of the budget (0: no scaling)
  std::uint32_t latency_sample_every = 4;  // time one allocation in this many
};

struct stress_counts {
  std::uint64_t ops = 0;             // allocation attempts + frees
  std::uint64_t allocs = 0;          // successful allocations
  std::uint64_t frees = 0;
  std::uint64_t ooms = 0;            // out_of_memory caught
  std::uint64_t checks = 0;          // patterns verified before a free (sampled on CUDA)
  std::uint64_t corruptions = 0;     // ... that did not match
  std::uint64_t deferred_frees = 0;  // frees that waited on events of other streams
  std::uint64_t cross_thread_frees = 0;
  std::uint64_t record_streams = 0;
  std::uint64_t bad_frees = 0;       // deallocate said unknown_pointer / not_live: a bug
  std::uint64_t bytes_allocated = 0; // requested bytes of successful allocations

  stress_counts& operator+=(const stress_counts& o) noexcept;
};

struct latency_summary {
  std::uint64_t samples = 0;
  std::uint64_t p50_ns = 0, p90_ns = 0, p99_ns = 0, p999_ns = 0, max_ns = 0;
};

struct held_block;  // an allocation a worker holds (stress_run.cpp)

class stress_run {
 public:
  stress_run(device_allocator& allocator, stress_work& work, stress_options options);
  ~stress_run();  // stops and joins
  stress_run(const stress_run&) = delete;
  stress_run& operator=(const stress_run&) = delete;

  void start();
  void stop() noexcept;              // asks the workers to finish (they free what they hold)
  bool finished() const noexcept;    // every worker has returned
  void join();                       // waits, then frees what is left in the mailboxes

  stress_counts counts() const noexcept;  // a live total; exact after join()
  latency_summary latency() const;        // after join()
  double lifetime_scale() const noexcept { return lifetime_scale_; }
  std::string error() const;              // the first unexpected exception a worker hit, or ""

 private:
  struct worker;
  void run_worker(worker& w) noexcept;
  void loop(worker& w);
  void allocate_one(worker& w);
  void free_one(worker& w, held_block& h, bool cross_thread);
  void set_error(const std::string& message) noexcept;

  device_allocator& allocator_;
  stress_work& work_;
  stress_options options_;
  std::vector<std::unique_ptr<worker>> workers_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<int> running_{0};
  mutable std::mutex error_mutex_;
  std::string error_;
  bool joined_ = false;
  double lifetime_scale_ = 1.0;
};

}  // namespace spillway::bench
