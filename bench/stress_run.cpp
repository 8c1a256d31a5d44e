// stress_run.cpp: the workers of spillway-stress. See stress_run.hpp for the workload.
#include "stress_run.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <utility>

#include "spillway/errors.hpp"

namespace spillway::bench {

struct held_block {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  std::uint64_t id = 0;
  stream_ref stream;
  std::uint64_t due = 0;      // the owner's loop turn at which it is freed
  bool handed_over = false;   // allocated by another thread
};

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t latency_reservoir = std::size_t{1} << 18;  // samples kept per thread

// splitmix64: fast, and good enough to pick sizes and coin flips.
struct rng {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) noexcept { return next() % n; }
  double unit() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool percent(unsigned p) noexcept { return below(100) < p; }
};

// A counter written by its worker only and read by the progress display: no locked instruction.
struct counter {
  std::atomic<std::uint64_t> value{0};
  void add(std::uint64_t n = 1) noexcept {
    value.store(value.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  std::uint64_t get() const noexcept { return value.load(std::memory_order_relaxed); }
};

enum class size_class { small, medium, large };

std::size_t log_uniform(rng& r, std::size_t lo, std::size_t hi) noexcept {
  if (hi <= lo) return lo;
  const double l = std::log(static_cast<double>(lo)), h = std::log(static_cast<double>(hi));
  const auto n = static_cast<std::size_t>(std::exp(l + r.unit() * (h - l)));
  return std::clamp(n, lo, hi);
}

std::pair<std::size_t, size_class> draw_size(rng& r, std::size_t max_size) {
  const auto u = r.below(100);
  if (u < 75 || max_size <= mib) {
    return {log_uniform(r, 64, std::min(mib, max_size)), size_class::small};
  }
  if (u < 97 || max_size <= 32 * mib) {
    return {log_uniform(r, mib + 1, std::min(32 * mib, max_size)), size_class::medium};
  }
  return {log_uniform(r, 32 * mib, max_size), size_class::large};
}

// In loop turns of the owning worker.
std::uint64_t draw_lifetime(rng& r, size_class c) {
  static constexpr unsigned short_percent[] = {40, 50, 80};
  static constexpr unsigned medium_percent[] = {45, 45, 20};
  const auto i = static_cast<int>(c);
  const auto u = r.below(100);
  if (u < short_percent[i]) return r.below(9);
  if (u < short_percent[i] + medium_percent[i]) return 8 + r.below(249);
  return 256 + r.below(3841);
}

// Scales draw_lifetime so that the expected live bytes of all threads are `fill` of the budget.
// Little's law: a worker allocates on half its turns (every allocation is freed once), so its
// expected live bytes are 0.5 x E[size x lifetime].
double scale_for_budget(const stress_options& o) {
  if (o.budget == 0 || o.fill <= 0) return 1.0;
  rng r{o.seed ^ 0xA5A5A5A5ull};
  double sum = 0;
  constexpr int samples = 20000;
  for (int i = 0; i < samples; ++i) {
    const auto [bytes, cls] = draw_size(r, o.max_size);
    sum += static_cast<double>(bytes) * static_cast<double>(draw_lifetime(r, cls) + 1);
  }
  const double live = 0.5 * sum / samples * o.threads;
  return live > 0 ? std::clamp(o.fill * static_cast<double>(o.budget) / live, 0.01, 100.0) : 1.0;
}

struct due_later {
  bool operator()(const held_block& a, const held_block& b) const noexcept { return a.due > b.due; }
};

}  // namespace

struct stress_run::worker {
  int index = 0;
  rng random{0};
  std::uint64_t turn = 0;
  std::uint64_t next_id = 0;
  std::uint64_t op_limit = 0;       // 0: until stopped
  std::uint64_t alloc_attempts = 0;
  std::vector<held_block> held;     // a min-heap on due
  std::vector<std::uint32_t> latencies;
  std::uint64_t latencies_seen = 0;

  // Allocations other threads handed over, to be freed here.
  std::mutex mailbox_mutex;
  std::vector<held_block> mailbox;
  std::atomic<bool> has_mail{false};
  std::vector<held_block> inbox;    // scratch for adopt

  counter ops, allocs, frees, ooms, checks, corruptions, deferred, cross_thread, records, bad_frees,
      bytes;
};

stress_counts& stress_counts::operator+=(const stress_counts& o) noexcept {
  ops += o.ops;
  allocs += o.allocs;
  frees += o.frees;
  ooms += o.ooms;
  checks += o.checks;
  corruptions += o.corruptions;
  deferred_frees += o.deferred_frees;
  cross_thread_frees += o.cross_thread_frees;
  record_streams += o.record_streams;
  bad_frees += o.bad_frees;
  bytes_allocated += o.bytes_allocated;
  return *this;
}

stress_run::stress_run(device_allocator& allocator, stress_work& work, stress_options options)
    : allocator_(allocator), work_(work), options_(std::move(options)) {
  if (options_.threads < 1) throw invalid_argument("spillway-stress: --threads must be at least 1");
  if (options_.streams.empty()) throw invalid_argument("spillway-stress: no streams to run on");
  if (options_.latency_sample_every == 0) options_.latency_sample_every = 1;
  const auto n = static_cast<std::uint64_t>(options_.threads);
  for (int i = 0; i < options_.threads; ++i) {
    auto w = std::make_unique<worker>();
    w->index = i;
    w->random.state = options_.seed * 0x100000001B3ull + static_cast<std::uint64_t>(i) * 7919;
    if (options_.ops > 0) {
      w->op_limit = options_.ops / n + (static_cast<std::uint64_t>(i) < options_.ops % n ? 1 : 0);
    }
    workers_.push_back(std::move(w));
  }
  lifetime_scale_ = scale_for_budget(options_);
}

stress_run::~stress_run() {
  stop();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void stress_run::start() {
  running_ = options_.threads;
  for (auto& w : workers_) threads_.emplace_back([this, &w] { run_worker(*w); });
}

void stress_run::stop() noexcept { stop_.store(true); }

bool stress_run::finished() const noexcept { return running_.load() == 0; }

void stress_run::run_worker(worker& w) noexcept {
  try {
    loop(w);
  } catch (const std::exception& e) {
    set_error("thread " + std::to_string(w.index) + ": " + e.what());
    stop();
  }
  // Free everything it still holds, also after an error, so that the final check means something.
  try {
    while (!w.held.empty()) {
      held_block h = w.held.back();
      w.held.pop_back();
      free_one(w, h, h.handed_over);
    }
  } catch (const std::exception& e) {
    set_error("thread " + std::to_string(w.index) + " while freeing: " + e.what());
  }
  --running_;
}

void stress_run::loop(worker& w) {
  while (!stop_.load(std::memory_order_relaxed)) {
    if (w.op_limit != 0 && w.ops.get() >= w.op_limit) break;
    ++w.turn;
    if (w.has_mail.load(std::memory_order_acquire)) {  // adopt cross-thread handovers
      {
        std::lock_guard lock(w.mailbox_mutex);
        w.inbox.swap(w.mailbox);
        w.has_mail.store(false, std::memory_order_relaxed);
      }
      for (held_block& h : w.inbox) {
        h.due = w.turn + w.random.below(64);
        w.held.push_back(h);
        std::push_heap(w.held.begin(), w.held.end(), due_later{});
      }
      w.inbox.clear();
    }
    if (!w.held.empty() && w.held.front().due <= w.turn) {
      std::pop_heap(w.held.begin(), w.held.end(), due_later{});
      held_block h = w.held.back();
      w.held.pop_back();
      free_one(w, h, h.handed_over);
    } else {
      allocate_one(w);
    }
  }
}

void stress_run::allocate_one(worker& w) {
  const auto [bytes, cls] = draw_size(w.random, options_.max_size);
  const auto& streams = options_.streams;
  const std::size_t si = w.random.below(streams.size());
  const stream_ref stream = streams[si];
  const bool timed = ++w.alloc_attempts % options_.latency_sample_every == 0;
  w.ops.add();

  void* ptr = nullptr;
  const auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  // Every timed call counts, those that end in out of memory too (they ran the whole pressure
  // path: the slowest calls a job sees).
  const auto note_latency = [&] {
    if (!timed) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - t0).count();
    const auto v = static_cast<std::uint32_t>(std::min<std::int64_t>(ns, UINT32_MAX));
    if (w.latencies.size() < latency_reservoir) {
      w.latencies.push_back(v);
    } else if (const auto j = w.random.below(w.latencies_seen + 1); j < latency_reservoir) {
      w.latencies[j] = v;
    }
    ++w.latencies_seen;
  };
  try {
    ptr = allocator_.allocate(bytes, stream);
  } catch (const out_of_memory&) {
    note_latency();
    // Expected under a budget. Give something back, like a job that shrinks its working set.
    w.ooms.add();
    if (!w.held.empty()) {
      std::pop_heap(w.held.begin(), w.held.end(), due_later{});
      held_block h = w.held.back();
      w.held.pop_back();
      free_one(w, h, h.handed_over);
    }
    return;
  }
  note_latency();
  w.allocs.add();
  w.bytes.add(bytes);

  held_block h{ptr, bytes, (static_cast<std::uint64_t>(w.index) << 40) | w.next_id++, stream};
  try {
    work_.fill(w.index, ptr, bytes, h.id, stream);
    if (streams.size() > 1 && w.random.percent(12)) {
      const stream_ref other = streams[(si + 1 + w.random.below(streams.size() - 1)) % streams.size()];
      allocator_.record_stream(ptr, other);
      w.records.add();
      work_.use_on_stream(w.index, ptr, bytes, h.id, other);
    }
  } catch (...) {
    allocator_.deallocate(ptr);
    throw;
  }
  if (w.random.percent(1)) {
    work_.background(w.index, streams[w.random.below(streams.size())],
                     1000 + w.random.below(49000));
  }

  if (options_.threads > 1 && w.random.percent(8)) {  // someone else frees it
    const auto n = static_cast<std::uint64_t>(options_.threads);
    worker& to = *workers_[(static_cast<std::uint64_t>(w.index) + 1 + w.random.below(n - 1)) % n];
    h.handed_over = true;
    std::lock_guard lock(to.mailbox_mutex);
    to.mailbox.push_back(h);
    to.has_mail.store(true, std::memory_order_release);
    return;
  }
  h.due = w.turn + static_cast<std::uint64_t>(
                       static_cast<double>(draw_lifetime(w.random, cls)) * lifetime_scale_);
  w.held.push_back(h);
  std::push_heap(w.held.begin(), w.held.end(), due_later{});
}

void stress_run::free_one(worker& w, held_block& h, bool cross_thread) {
  w.ops.add();
  const check_result c = work_.verify(w.index, h.ptr, h.bytes, h.id, h.stream);
  if (c != check_result::skipped) w.checks.add();
  if (c == check_result::corrupt) {
    w.corruptions.add();
    if (w.corruptions.get() <= 3) {  // the first few of each thread, by name
      std::lock_guard lock(error_mutex_);
      std::fprintf(stderr, "\nspillway-stress: CORRUPTION: allocation %llu (%p, %zu bytes, stream "
                   "%llu) does not hold its pattern at free\n",
                   static_cast<unsigned long long>(h.id), h.ptr, h.bytes,
                   static_cast<unsigned long long>(h.stream.value));
    }
  }
  switch (allocator_.deallocate(h.ptr)) {
    case free_status::freed: break;
    case free_status::deferred: w.deferred.add(); break;
    case free_status::unknown_pointer:
    case free_status::not_live:
    case free_status::null_pointer: w.bad_frees.add(); break;
  }
  w.frees.add();
  if (cross_thread) w.cross_thread.add();
}

void stress_run::join() {
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  if (joined_) return;
  joined_ = true;
  // Handovers that arrived after their receiver finished: freed here, as thread 0.
  for (auto& to : workers_) {
    for (held_block& h : to->mailbox) free_one(*workers_[0], h, true);
    to->mailbox.clear();
  }
}

stress_counts stress_run::counts() const noexcept {
  stress_counts total;
  for (const auto& w : workers_) {
    stress_counts c;
    c.ops = w->ops.get();
    c.allocs = w->allocs.get();
    c.frees = w->frees.get();
    c.ooms = w->ooms.get();
    c.checks = w->checks.get();
    c.corruptions = w->corruptions.get();
    c.deferred_frees = w->deferred.get();
    c.cross_thread_frees = w->cross_thread.get();
    c.record_streams = w->records.get();
    c.bad_frees = w->bad_frees.get();
    c.bytes_allocated = w->bytes.get();
    total += c;
  }
  return total;
}

latency_summary stress_run::latency() const {
  std::vector<std::uint32_t> all;
  for (const auto& w : workers_) all.insert(all.end(), w->latencies.begin(), w->latencies.end());
  latency_summary s;
  s.samples = all.size();
  if (all.empty()) return s;
  std::sort(all.begin(), all.end());
  auto at = [&](double q) {
    return all[std::min(all.size() - 1, static_cast<std::size_t>(q * static_cast<double>(all.size())))];
  };
  s.p50_ns = at(0.50);
  s.p90_ns = at(0.90);
  s.p99_ns = at(0.99);
  s.p999_ns = at(0.999);
  s.max_ns = all.back();
  return s;
}

std::string stress_run::error() const {
  std::lock_guard lock(error_mutex_);
  return error_;
}

void stress_run::set_error(const std::string& message) noexcept {
  if (message.empty()) return;
  std::lock_guard lock(error_mutex_);
  if (error_.empty()) error_ = message;
}

}  // namespace spillway::bench
