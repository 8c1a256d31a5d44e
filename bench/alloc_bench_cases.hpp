// alloc_bench_cases: the cases of spillway-alloc-bench, written once for every allocator under test.
//
// A subject is a small class with inline methods (no virtual call in the timed loop):
//   std::string name() const;
//   void thread_init();                                   // per thread, before it allocates
//   void* allocate(std::size_t bytes, stream_ref s);
//   void deallocate(void* p, stream_ref s);
//   void deallocate_after(void* p, stream_ref s, stream_ref other);  // free once `other` is done
//
// Cases (each timed as alloc+free pairs, see time_pairs):
//   cache_hit     a 4 KiB hole between two live 4 KiB blocks: the pair takes it exactly and gives it
//                 back, with no split and no coalesce
//   split         4 KiB from a cached 2 MiB segment: the pair splits it and the free coalesces it
//   cross_stream  alloc on s1, used on s2 (record_stream, or an event + stream wait for the peers),
//                 free. spillway frees the block once an event on s2 completes; the reap that makes
//                 it reusable runs when the segment is used up, so its cost is amortised over the
//                 pairs, as in a real run
//   multi_thread  N threads, each on its own stream, doing cache_hit pairs on one shared allocator;
//                 the figure is the per-pair median over every thread's batches
#pragma once

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "spillway/device_backend.hpp"

namespace spillway::bench {

struct timing {
  int batches = 200;            // timed batches per case
  int pairs_per_batch = 1000;   // at most; fewer for slow allocators (a batch aims at ~100 us)
};

struct case_result {
  std::string name;
  std::string allocator;
  double median_ns = 0;
  double p10_ns = 0;
  double p90_ns = 0;
  // Time of the timed phase x threads / pairs timed. For multi_thread this counts the time a thread
  // waits for the others: a lock that lets one thread's batches run alone while the other waits
  // shows up here, not in the median.
  double mean_ns = 0;
  std::uint64_t iterations = 0;  // pairs timed
  int threads = 1;
};

inline constexpr std::size_t bench_bytes = 4096;

struct batch_times {
  std::vector<double> ns_per_pair;  // one entry per timed batch
  int pairs_per_batch = 0;
  std::chrono::steady_clock::time_point start, end;  // of the timed batches
};

// Times `pair` (one alloc+free pair) in batches, after a warm-up.
template <class Pair>
batch_times time_pairs(Pair&& pair, const timing& t) {
  using clock = std::chrono::steady_clock;
  auto ns_since = [](clock::time_point t0) {
    return static_cast<double>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count());
  };
  // Calibrate: a batch should take ~100 us, so that slow allocators (cudaMalloc) finish in time
  // and fast ones are timed over many pairs.
  constexpr int probe = 100;
  auto t0 = clock::now();
  for (int i = 0; i < probe; ++i) pair();
  const double per_pair = std::max(1.0, ns_since(t0) / probe);
  batch_times out;
  out.pairs_per_batch =
      std::clamp(static_cast<int>(100'000 / per_pair), std::min(10, t.pairs_per_batch), t.pairs_per_batch);
  // Warm up: 10 batches or ~20 ms, whichever is less.
  const int warmup = std::min(10 * out.pairs_per_batch, static_cast<int>(20'000'000 / per_pair) + 1);
  for (int i = 0; i < warmup; ++i) pair();

  out.ns_per_pair.reserve(static_cast<std::size_t>(t.batches));
  out.start = clock::now();
  for (int b = 0; b < t.batches; ++b) {
    t0 = clock::now();
    for (int i = 0; i < out.pairs_per_batch; ++i) pair();
    out.ns_per_pair.push_back(ns_since(t0) / out.pairs_per_batch);
  }
  out.end = clock::now();
  return out;
}

// Median, p10 and p90 over batches (several threads' batches are merged first).
inline case_result summarize(std::string name, std::string allocator,
                             const std::vector<batch_times>& runs) {
  case_result r{std::move(name), std::move(allocator)};
  std::vector<double> ns;
  for (const batch_times& b : runs) {
    ns.insert(ns.end(), b.ns_per_pair.begin(), b.ns_per_pair.end());
    r.iterations += b.ns_per_pair.size() * static_cast<std::uint64_t>(b.pairs_per_batch);
  }
  r.threads = static_cast<int>(runs.size());
  if (ns.empty() || r.iterations == 0) return r;
  auto start = runs.front().start;
  auto end = runs.front().end;
  for (const batch_times& b : runs) {
    start = std::min(start, b.start);
    end = std::max(end, b.end);
  }
  r.mean_ns = std::chrono::duration<double, std::nano>(end - start).count() * r.threads /
              static_cast<double>(r.iterations);
  std::sort(ns.begin(), ns.end());
  auto at = [&](double q) {
    return ns[static_cast<std::size_t>(q * static_cast<double>(ns.size() - 1) + 0.5)];
  };
  r.median_ns = at(0.5);
  r.p10_ns = at(0.1);
  r.p90_ns = at(0.9);
  return r;
}

// --- the cases ------------------------------------------------------------------------------------

template <class Subject>
case_result cache_hit_case(Subject& a, stream_ref s, const timing& t) {
  a.thread_init();
  void* below = a.allocate(bench_bytes, s);
  void* hole = a.allocate(bench_bytes, s);
  void* above = a.allocate(bench_bytes, s);
  a.deallocate(hole, s);
  const batch_times bt = time_pairs([&] { a.deallocate(a.allocate(bench_bytes, s), s); }, t);
  a.deallocate(below, s);
  a.deallocate(above, s);
  return summarize("cache_hit", a.name(), {bt});
}

template <class Subject>
case_result split_case(Subject& a, stream_ref s, const timing& t) {
  a.thread_init();
  a.deallocate(a.allocate(bench_bytes, s), s);  // leaves one cached segment
  const batch_times bt = time_pairs([&] { a.deallocate(a.allocate(bench_bytes, s), s); }, t);
  return summarize("split", a.name(), {bt});
}

template <class Subject>
case_result cross_stream_case(Subject& a, stream_ref s1, stream_ref s2, const timing& t) {
  a.thread_init();
  const batch_times bt = time_pairs(
      [&] { a.deallocate_after(a.allocate(bench_bytes, s1), s1, s2); }, t);
  return summarize("cross_stream", a.name(), {bt});
}

template <class Subject>
case_result multi_thread_case(Subject& a, const std::vector<stream_ref>& streams, const timing& t) {
  std::vector<batch_times> runs(streams.size());
  std::vector<std::exception_ptr> errors(streams.size());
  std::barrier start(static_cast<std::ptrdiff_t>(streams.size()));
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < streams.size(); ++i) {
    threads.emplace_back([&, i] {
      const stream_ref s = streams[i];
      void* below = nullptr;
      void* above = nullptr;
      try {
        a.thread_init();
        below = a.allocate(bench_bytes, s);
        void* hole = a.allocate(bench_bytes, s);
        above = a.allocate(bench_bytes, s);
        a.deallocate(hole, s);
      } catch (...) {
        errors[i] = std::current_exception();
        start.arrive_and_drop();  // the others start without this thread
        return;
      }
      start.arrive_and_wait();
      try {
        runs[i] = time_pairs([&] { a.deallocate(a.allocate(bench_bytes, s), s); }, t);
        a.deallocate(below, s);
        a.deallocate(above, s);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return summarize("multi_thread", a.name(), runs);
}

}  // namespace spillway::bench
