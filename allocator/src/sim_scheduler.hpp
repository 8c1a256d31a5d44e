// sim_scheduler: the streams, events and copy engines of the simulated device, run as a
// discrete-event simulation on a virtual clock (nanoseconds). sim_device.hpp describes the model;
// this is how it runs.
//
// Contract
// - Called with sim_device's mutex held. Methods named *_releasing_lock release it while a
//   kernel's effect runs and hold it again when they return; nothing else releases it.
// - A stream is a FIFO of ops. Its head op starts when the stream is not held and, for a wait,
//   once the awaited record has completed, and, for a copy, once its engine is free (an engine
//   serves waiting copies first come, first served). Engines: host_to_device, device_to_host, and
//   one shared by device_to_device and host_to_host copies at d2d_bandwidth. A started op ends at
//   start + duration: copies latency + bytes / bandwidth, kernels their duration, records 0; a
//   0-byte copy is a no-op of duration 0 that takes no engine.
// - Ops complete when a call moves the clock to or past their end, in end order (ties: in the
//   order they started). Completion applies the op's effect: a copy's memmove (under the lock),
//   a kernel's callback (without it), an event record's "done". Each op starts at the end of the
//   op it waited for, so the timing does not depend on which call completed what.
// - While a kernel's effect runs its stream stays at that kernel: nothing behind it starts and no
//   event behind it completes. Other threads may meanwhile complete independent work, as
//   independent streams run concurrently on a GPU. An exception from an effect propagates out of
//   the call that ran it; the kernel still counts as completed.
// - hold(s) freezes s: an op in flight is cancelled (its engine freed, its effect not applied)
//   and starts again, with its full duration, at release(s). destroy_stream lifts a hold and lets
//   queued work run; the stream disappears once it is idle.
// - Clock: manual, it moves only by advance(), run_until_idle() and the synchronize calls;
//   realtime, it is wall time since construction * time_scale + an offset. Blocking calls never
//   sleep: they jump the clock to the completion they wait for (realtime: by growing the offset,
//   so the clock stays monotonic). A wait that can never end (a held stream on the path, or the
//   kernel whose effect is running on this very thread) throws std::logic_error before anything
//   runs, where it can be seen from the queued work.
// - Out of host memory (std::bad_alloc from the scheduler's own lists): an enqueue that throws
//   leaves its stream as it was. Elsewhere (completing work, hold, release) it propagates out of
//   the call and may leave a stream stalled for good (a kernel's effect not run, a waiter not
//   woken): a wait on that stream then throws the logic_error above rather than hanging.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "spillway/sim_device.hpp"

namespace spillway::detail {

class sim_scheduler {
 public:
  using lock_type = std::unique_lock<std::mutex>;

  // `name` ("sim:0") prefixes error messages. Stream 0 exists from the start.
  sim_scheduler(const sim_config& config, sim_counters& counters, std::string name);

  // --- handles: unknown ones throw invalid_argument naming the value and the call ---
  void check_stream(std::uintptr_t s, const char* call) const;
  std::uintptr_t create_stream();
  void destroy_stream(std::uintptr_t s) noexcept;  // 0 and unknown streams are ignored
  std::uintptr_t create_event();
  void destroy_event(std::uintptr_t e) noexcept;
  void hold(std::uintptr_t s);
  void release(std::uintptr_t s);
  bool stream_idle(std::uintptr_t s) const;
  bool event_completed(std::uintptr_t e) const;  // never recorded: true

  // --- work ---
  void enqueue_copy(void* dst, const void* src, std::size_t bytes, copy_kind kind, std::uintptr_t s);
  void enqueue_kernel(std::uintptr_t s, std::uint64_t duration_ns, std::function<void()> effect);
  void enqueue_record(std::uintptr_t e, std::uintptr_t s);
  void enqueue_wait(std::uintptr_t s, std::uintptr_t e);  // never recorded: nothing to wait for

  // --- clock ---
  std::uint64_t now() const noexcept { return now_; }
  void skip_clock(std::uint64_t ns) noexcept;  // moves the clock; the next catch-up completes
  void catch_up_releasing_lock(lock_type& lock);  // completes all that ends by the current time
  void advance_releasing_lock(lock_type& lock, std::uint64_t ns);
  void run_until_idle_releasing_lock(lock_type& lock);
  void synchronize_stream_releasing_lock(lock_type& lock, std::uintptr_t s);
  void synchronize_event_releasing_lock(lock_type& lock, std::uintptr_t e);
  void synchronize_device_releasing_lock(lock_type& lock);

 private:
  struct waiter {  // a stream parked on an engine or a record; stale once its token moved on
    std::uintptr_t stream = 0;
    std::uint64_t token = 0;
  };
  struct point {  // one record_event
    bool done = false;
    std::uintptr_t stream = 0;
    std::uint64_t ordinal = 0;  // the record op's number on its stream (1 = first ever enqueued)
    std::vector<waiter> waiters;
  };
  enum class op_kind : std::uint8_t { copy, kernel, record, wait };
  struct op {
    op_kind kind = op_kind::kernel;
    copy_kind direction = copy_kind::host_to_device;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
    std::uint64_t duration = 0;
    std::uint64_t source_print = 0;  // copy: source_fingerprint when it started
    std::function<void()> effect;
    std::shared_ptr<point> at;  // record: the point it completes; wait: the point it waits for
  };
  enum class head_state : std::uint8_t { idle, running, waiting_engine, waiting_event, in_effect };
  struct stream {
    std::deque<op> ops;  // the head is ops.front(), including while it runs
    head_state head = head_state::idle;
    bool held = false;
    bool destroyed = false;  // destroy_stream was called: erased once idle
    int engine = -1;         // the engine a running copy occupies
    std::uint64_t token = 0;  // bumped when hold() cancels the head: old parkings go stale
    std::uint64_t enqueued = 0;
    std::uint64_t completed = 0;
    std::thread::id effect_thread;  // while head == in_effect
  };
  struct engine {
    bool busy = false;
    std::uint64_t free_at = 0;
    std::deque<waiter> queue;
  };
  struct timed {  // a running op's end; stale when its stream's token moved on
    std::uint64_t end = 0;
    std::uint64_t seq = 0;
    std::uintptr_t stream = 0;
    std::uint64_t token = 0;
    friend bool operator>(const timed& a, const timed& b) noexcept {
      return a.end != b.end ? a.end > b.end : a.seq > b.seq;
    }
  };
  static constexpr int k_engines = 3;

  stream& stream_at(std::uintptr_t s, const char* call);
  const stream& stream_at(std::uintptr_t s, const char* call) const;
  std::shared_ptr<point>& event_at(std::uintptr_t e, const char* call);
  void push(std::uintptr_t sid, stream& s, op o);

  // Scheduling steps (lock held throughout).
  void try_start(std::uintptr_t sid, stream& s, std::uint64_t t);
  void start_on_engine(std::uintptr_t sid, stream& s, int e, std::uint64_t t);
  void schedule(std::uintptr_t sid, stream& s, std::uint64_t end);
  void pop_head(std::uintptr_t sid, stream& s);
  void free_engine(int e, std::uint64_t t);
  void cancel_head(stream& s);
  void sweep_destroyed() noexcept;
  bool pop_due(std::uint64_t limit, timed& out);

  // Completion steps.
  void complete_releasing_lock(lock_type& lock, const timed& t);
  void run_effect_releasing_lock(lock_type& lock, const timed& t, stream& s);
  void finish_kernel(const timed& t);
  void complete_until_releasing_lock(lock_type& lock, std::uint64_t limit);
  void wait_until_releasing_lock(lock_type& lock, const std::function<bool()>& done,
                                 const std::function<std::string()>& why_blocked);

  // Clock and diagnosis.
  std::uint64_t wall_now() const noexcept;
  void jump_clock_to(std::uint64_t t) noexcept;
  bool effects_running_elsewhere() const noexcept;
  bool effect_running_here() const noexcept;
  std::string find_blocker(std::uintptr_t sid, std::size_t count) const;
  [[noreturn]] void throw_blocked(const std::string& call, const std::string& reason) const;

  const sim_config& config_;
  sim_counters& counters_;
  std::string name_;
  std::unordered_map<std::uintptr_t, stream> streams_;
  std::uintptr_t next_stream_ = 1;
  std::unordered_map<std::uintptr_t, std::shared_ptr<point>> events_;  // null: never recorded
  std::uintptr_t next_event_ = 1;
  engine engines_[k_engines];
  std::priority_queue<timed, std::vector<timed>, std::greater<>> running_;
  std::uint64_t seq_ = 0;
  std::uint64_t now_ = 0;
  std::uint64_t offset_ = 0;  // realtime: what blocking calls and advance() added to wall time
  std::chrono::steady_clock::time_point start_;
  std::vector<std::thread::id> effect_threads_;  // one entry per kernel effect running now
  std::vector<std::uintptr_t> maybe_destroyed_;  // destroyed streams that may have gone idle
  std::condition_variable effect_done_;
};

}  // namespace spillway::detail
