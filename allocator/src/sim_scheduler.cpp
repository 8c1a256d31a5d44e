// sim_scheduler.cpp: the simulated device's streams, events and copy engines on a virtual clock.
#include "sim_scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#include "spillway/errors.hpp"

namespace spillway::detail {
namespace {

constexpr std::uint64_t k_forever = std::numeric_limits<std::uint64_t>::max();

// Clock arithmetic saturates: a kernel of duration "forever" must not wrap round to "now".
std::uint64_t plus(std::uint64_t t, std::uint64_t ns) noexcept {
  return ns > k_forever - t ? k_forever : t + ns;
}

// The engine a copy occupies; -1 for a 0-byte copy, which moves nothing.
int engine_of(copy_kind kind, std::size_t bytes) noexcept {
  if (bytes == 0) return -1;
  switch (kind) {
    case copy_kind::host_to_device: return 0;
    case copy_kind::device_to_host: return 1;
    default: return 2;  // device_to_device and host_to_host
  }
}

double bandwidth_of(const sim_config& config, copy_kind kind) noexcept {
  switch (kind) {
    case copy_kind::host_to_device: return config.h2d_bandwidth;
    case copy_kind::device_to_host: return config.d2h_bandwidth;
    default: return config.d2d_bandwidth;
  }
}

}  // namespace

sim_scheduler::sim_scheduler(const sim_config& config, sim_counters& counters, std::string name)
    : config_(config), counters_(counters), name_(std::move(name)),
      start_(std::chrono::steady_clock::now()) {
  streams_.emplace(0, stream{});
}

// --- handles ---------------------------------------------------------------------------------------

sim_scheduler::stream& sim_scheduler::stream_at(std::uintptr_t s, const char* call) {
  return const_cast<stream&>(std::as_const(*this).stream_at(s, call));
}

const sim_scheduler::stream& sim_scheduler::stream_at(std::uintptr_t s, const char* call) const {
  auto it = streams_.find(s);
  if (it == streams_.end() || it->second.destroyed)
    throw invalid_argument(std::string(call) + " on " + name_ + ": unknown stream " +
                           std::to_string(s) + "; expected 0 or a stream from create_stream()");
  return it->second;
}

void sim_scheduler::check_stream(std::uintptr_t s, const char* call) const { stream_at(s, call); }

std::shared_ptr<sim_scheduler::point>& sim_scheduler::event_at(std::uintptr_t e, const char* call) {
  auto it = events_.find(e);
  if (it == events_.end())
    throw invalid_argument(std::string(call) + " on " + name_ + ": unknown event " +
                           std::to_string(e) + "; expected an event from create_event()");
  return it->second;
}

std::uintptr_t sim_scheduler::create_stream() {
  const std::uintptr_t id = next_stream_++;  // never reused: a stale handle stays unknown
  streams_.emplace(id, stream{});
  return id;
}

void sim_scheduler::destroy_stream(std::uintptr_t sid) noexcept {
  auto it = streams_.find(sid);
  if (sid == 0 || it == streams_.end() || it->second.destroyed) return;
  stream& s = it->second;
  s.destroyed = true;
  s.held = false;  // as in CUDA, queued work still runs; nobody could release the hold any more
  maybe_destroyed_.push_back(sid);
  try_start(sid, s, now_);
  sweep_destroyed();
}

std::uintptr_t sim_scheduler::create_event() {
  const std::uintptr_t id = next_event_++;
  events_.emplace(id, nullptr);
  return id;
}

void sim_scheduler::destroy_event(std::uintptr_t e) noexcept {
  events_.erase(e);  // queued records and waits keep their point alive
}

void sim_scheduler::hold(std::uintptr_t sid) {
  stream& s = stream_at(sid, "hold");
  s.held = true;
  cancel_head(s);
}

void sim_scheduler::release(std::uintptr_t sid) {
  stream& s = stream_at(sid, "release");
  s.held = false;
  try_start(sid, s, now_);
}

bool sim_scheduler::stream_idle(std::uintptr_t s) const { return stream_at(s, "stream_idle").ops.empty(); }

bool sim_scheduler::event_completed(std::uintptr_t e) const {
  auto it = events_.find(e);
  if (it == events_.end())
    throw invalid_argument("event_completed on " + name_ + ": unknown event " + std::to_string(e) +
                           "; expected an event from create_event()");
  return it->second == nullptr || it->second->done;
}

// --- work ------------------------------------------------------------------------------------------

void sim_scheduler::enqueue_copy(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                                 std::uintptr_t sid) {
  stream& s = stream_at(sid, "copy_async");
  op o;
  o.kind = op_kind::copy;
  o.direction = kind;
  o.dst = dst;
  o.src = src;
  o.bytes = bytes;
  if (bytes > 0) {
    const double ns = static_cast<double>(bytes) * 1e9 / bandwidth_of(config_, kind);
    const std::uint64_t transfer = ns < 9e18 ? static_cast<std::uint64_t>(std::llround(ns)) : k_forever;
    o.duration = plus(config_.copy_latency_ns, transfer);
  }
  push(sid, s, std::move(o));
}

void sim_scheduler::enqueue_kernel(std::uintptr_t sid, std::uint64_t duration_ns,
                                   std::function<void()> effect) {
  stream& s = stream_at(sid, "launch");
  op o;
  o.kind = op_kind::kernel;
  o.duration = duration_ns;
  o.effect = std::move(effect);
  push(sid, s, std::move(o));
}

void sim_scheduler::enqueue_record(std::uintptr_t e, std::uintptr_t sid) {
  std::shared_ptr<point>& latest = event_at(e, "record_event");
  stream& s = stream_at(sid, "record_event");
  auto p = std::make_shared<point>();
  p->stream = sid;
  p->ordinal = s.enqueued + 1;
  op o;
  o.kind = op_kind::record;
  o.at = p;
  push(sid, s, std::move(o));
  latest = std::move(p);  // a later query or wait sees this record, as cudaEventRecord does
}

void sim_scheduler::enqueue_wait(std::uintptr_t sid, std::uintptr_t e) {
  std::shared_ptr<point>& latest = event_at(e, "stream_wait_event");
  stream& s = stream_at(sid, "stream_wait_event");
  if (latest == nullptr || latest->done) return;  // nothing left to wait for
  op o;
  o.kind = op_kind::wait;
  o.at = latest;
  push(sid, s, std::move(o));
}

// An enqueue that throws (the host out of memory) leaves the stream as it was, as a failed CUDA
// call does: try_start changes a stream's state only after the step that may throw.
void sim_scheduler::push(std::uintptr_t sid, stream& s, op o) {
  s.ops.push_back(std::move(o));
  ++s.enqueued;
  try {
    try_start(sid, s, now_);
  } catch (...) {
    s.ops.pop_back();  // not started: try_start threw before it changed the head's state
    --s.enqueued;
    throw;
  }
}

// --- scheduling ------------------------------------------------------------------------------------

void sim_scheduler::try_start(std::uintptr_t sid, stream& s, std::uint64_t t) {
  while (!s.held && s.head == head_state::idle && !s.ops.empty()) {
    op& o = s.ops.front();
    if (o.kind == op_kind::wait) {
      if (o.at->done) {
        pop_head(sid, s);
        continue;
      }
      o.at->waiters.push_back({sid, s.token});
      s.head = head_state::waiting_event;
      return;
    }
    if (o.kind == op_kind::copy) {
      if (const int e = engine_of(o.direction, o.bytes); e >= 0) {
        if (engines_[e].busy) {
          engines_[e].queue.push_back({sid, s.token});
          s.head = head_state::waiting_engine;
        } else {
          start_on_engine(sid, s, e, t);
        }
        return;
      }
    }
    schedule(sid, s, plus(t, o.duration));
    return;
  }
}

namespace {
// A copy's bytes are moved when it completes; on a GPU they are read while it runs. So that a
// missing wait for the source's producer cannot go unseen when the producer happens to finish
// first, the source is fingerprinted when the copy starts and again when it completes, and a
// change is counted (sim_counters::copy_sources_changed). Up to 256 bytes at its start, middle
// and end (FNV-1a): O(1) per copy, whatever its size.
std::uint64_t source_fingerprint(const void* src, std::size_t bytes) noexcept {
  if (src == nullptr || bytes == 0) return 0;
  const auto* p = static_cast<const unsigned char*>(src);
  constexpr std::size_t window = 256;
  std::uint64_t h = 14695981039346656037ull;
  const auto mix = [&](std::size_t from, std::size_t to) {
    for (std::size_t i = from; i < to; ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  if (bytes <= 3 * window) {
    mix(0, bytes);
  } else {
    mix(0, window);
    mix(bytes / 2 - window / 2, bytes / 2 + window / 2);
    mix(bytes - window, bytes);
  }
  return h;
}
}  // namespace

void sim_scheduler::start_on_engine(std::uintptr_t sid, stream& s, int e, std::uint64_t t) {
  op& o = s.ops.front();
  o.source_print = source_fingerprint(o.src, o.bytes);
  engine& en = engines_[e];
  schedule(sid, s, plus(std::max(t, en.free_at), o.duration));
  en.busy = true;
  s.engine = e;
}

void sim_scheduler::schedule(std::uintptr_t sid, stream& s, std::uint64_t end) {
  running_.push(timed{end, seq_, sid, s.token});  // the only step that may throw
  ++seq_;
  s.head = head_state::running;
}

void sim_scheduler::pop_head(std::uintptr_t sid, stream& s) {
  s.ops.pop_front();
  ++s.completed;
  s.head = head_state::idle;
  if (s.destroyed && s.ops.empty()) maybe_destroyed_.push_back(sid);
}

// Hands the engine to the first copy still parked on it, starting at t.
void sim_scheduler::free_engine(int e, std::uint64_t t) {
  engine& en = engines_[e];
  en.busy = false;
  en.free_at = t;
  while (!en.queue.empty()) {
    const waiter w = en.queue.front();
    en.queue.pop_front();
    auto it = streams_.find(w.stream);
    if (it == streams_.end() || it->second.token != w.token ||
        it->second.head != head_state::waiting_engine)
      continue;
    it->second.head = head_state::idle;
    start_on_engine(w.stream, it->second, e, t);
    return;
  }
}

// hold(): the head stops where it is. Parkings and the running entry go stale with the token; a
// running copy gives its engine back now.
void sim_scheduler::cancel_head(stream& s) {
  switch (s.head) {
    case head_state::running:
    case head_state::waiting_engine:
    case head_state::waiting_event: {
      const bool had_engine = s.head == head_state::running && s.engine >= 0;
      const int e = s.engine;
      ++s.token;
      s.head = head_state::idle;
      s.engine = -1;
      if (had_engine) free_engine(e, now_);
      return;
    }
    case head_state::idle:
    case head_state::in_effect:  // cannot be stopped half way; nothing behind it will start
      return;
  }
}

void sim_scheduler::sweep_destroyed() noexcept {
  for (std::uintptr_t sid : maybe_destroyed_) {
    auto it = streams_.find(sid);
    if (it != streams_.end() && it->second.destroyed && it->second.ops.empty() &&
        it->second.head == head_state::idle)
      streams_.erase(it);
  }
  maybe_destroyed_.clear();
}

bool sim_scheduler::pop_due(std::uint64_t limit, timed& out) {
  while (!running_.empty() && running_.top().end <= limit) {
    const timed t = running_.top();
    running_.pop();
    auto it = streams_.find(t.stream);
    if (it != streams_.end() && it->second.token == t.token && it->second.head == head_state::running) {
      out = t;
      return true;
    }
  }
  return false;
}

// --- completion ------------------------------------------------------------------------------------

void sim_scheduler::complete_releasing_lock(lock_type& lock, const timed& t) {
  now_ = std::max(now_, t.end);
  stream& s = streams_.at(t.stream);
  op& o = s.ops.front();
  switch (o.kind) {
    case op_kind::copy: {
      if (s.engine >= 0 && source_fingerprint(o.src, o.bytes) != o.source_print) {
        ++counters_.copy_sources_changed;  // written while the copy ran: a missing wait
      }
      if (o.bytes > 0) std::memmove(o.dst, o.src, o.bytes);  // memmove: d2d copies may overlap
      ++counters_.copies;
      counters_.bytes_copied[static_cast<int>(o.direction)] += o.bytes;
      const int e = s.engine;
      s.engine = -1;
      if (e >= 0) free_engine(e, t.end);  // parked copies of other streams go first
      break;
    }
    case op_kind::record: {
      o.at->done = true;
      const std::vector<waiter> waiters = std::move(o.at->waiters);
      for (const waiter& w : waiters) {
        auto it = streams_.find(w.stream);
        if (it == streams_.end() || it->second.token != w.token ||
            it->second.head != head_state::waiting_event)
          continue;
        pop_head(w.stream, it->second);  // the wait itself
        try_start(w.stream, it->second, t.end);
      }
      break;
    }
    case op_kind::kernel:
      if (o.effect) return run_effect_releasing_lock(lock, t, s);
      ++counters_.kernels;
      break;
    case op_kind::wait:  // waits never run; they are popped when their point completes
      break;
  }
  pop_head(t.stream, s);
  try_start(t.stream, s, t.end);
  sweep_destroyed();
}

void sim_scheduler::run_effect_releasing_lock(lock_type& lock, const timed& t, stream& s) {
  std::function<void()> effect = std::move(s.ops.front().effect);
  s.head = head_state::in_effect;
  s.effect_thread = std::this_thread::get_id();
  effect_threads_.push_back(s.effect_thread);
  lock.unlock();  // the effect may call back into the device, or into an allocator
  try {
    effect();
  } catch (...) {
    effect = nullptr;
    lock.lock();
    finish_kernel(t);
    throw;
  }
  effect = nullptr;  // its captures die without the lock too
  lock.lock();
  finish_kernel(t);
}

void sim_scheduler::finish_kernel(const timed& t) {
  auto me = std::find(effect_threads_.begin(), effect_threads_.end(), std::this_thread::get_id());
  if (me != effect_threads_.end()) effect_threads_.erase(me);
  stream& s = streams_.at(t.stream);  // not erased: its ops still hold this kernel
  ++counters_.kernels;
  pop_head(t.stream, s);
  effect_done_.notify_all();  // first: the waiters wake even if starting the next op throws
  try_start(t.stream, s, t.end);
  sweep_destroyed();
}

void sim_scheduler::complete_until_releasing_lock(lock_type& lock, std::uint64_t limit) {
  timed t;
  while (pop_due(limit, t)) complete_releasing_lock(lock, t);
  now_ = std::max(now_, limit);
}

// Completes work in end order, jumping the clock, until done(); waits for effects running on
// other threads when nothing else can move; throws when nothing ever will.
void sim_scheduler::wait_until_releasing_lock(lock_type& lock, const std::function<bool()>& done,
                                              const std::function<std::string()>& why_blocked) {
  for (;;) {
    if (done()) return;
    timed t;
    if (pop_due(k_forever, t)) {
      jump_clock_to(t.end);
      complete_releasing_lock(lock, t);
    } else if (effects_running_elsewhere()) {
      effect_done_.wait(lock);
    } else {
      throw std::logic_error(why_blocked());
    }
  }
}

// --- clock -----------------------------------------------------------------------------------------

std::uint64_t sim_scheduler::wall_now() const noexcept {
  const auto elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now() - start_);
  return plus(static_cast<std::uint64_t>(static_cast<double>(elapsed.count()) * config_.time_scale),
              offset_);
}

void sim_scheduler::jump_clock_to(std::uint64_t t) noexcept {
  now_ = std::max(now_, t);
  if (config_.clock != clock_mode::realtime) return;
  if (const std::uint64_t w = wall_now(); w < t) offset_ = plus(offset_, t - w);
}

void sim_scheduler::skip_clock(std::uint64_t ns) noexcept {
  if (config_.clock == clock_mode::realtime)
    offset_ = plus(offset_, ns);
  else
    now_ = plus(now_, ns);
}

void sim_scheduler::catch_up_releasing_lock(lock_type& lock) {
  const std::uint64_t target = config_.clock == clock_mode::realtime ? std::max(now_, wall_now()) : now_;
  complete_until_releasing_lock(lock, target);
}

void sim_scheduler::advance_releasing_lock(lock_type& lock, std::uint64_t ns) {
  skip_clock(ns);
  catch_up_releasing_lock(lock);
}

void sim_scheduler::run_until_idle_releasing_lock(lock_type& lock) {
  for (;;) {
    timed t;
    if (pop_due(k_forever, t)) {
      jump_clock_to(t.end);
      complete_releasing_lock(lock, t);
    } else if (!effect_running_here() && effects_running_elsewhere()) {
      effect_done_.wait(lock);  // their kernels may unblock more work
    } else {
      return;
    }
  }
}

// --- blocking calls --------------------------------------------------------------------------------

void sim_scheduler::synchronize_stream_releasing_lock(lock_type& lock, std::uintptr_t sid) {
  const stream& s = stream_at(sid, "synchronize_stream");
  if (s.ops.empty()) return;
  const std::string call = "synchronize_stream(" + std::to_string(sid) + ")";
  if (std::string why = find_blocker(sid, s.ops.size()); !why.empty()) throw_blocked(call, why);
  const std::uint64_t target = s.enqueued;  // work enqueued later is not waited for
  auto done = [&] {
    auto it = streams_.find(sid);
    return it == streams_.end() || it->second.completed >= target;
  };
  auto why = [&] {
    const stream& now = streams_.at(sid);
    std::string reason = find_blocker(sid, static_cast<std::size_t>(target - now.completed));
    return call + " on " + name_ + " would never return: " +
           (reason.empty() ? "its work cannot progress" : reason);
  };
  wait_until_releasing_lock(lock, done, why);
}

void sim_scheduler::synchronize_event_releasing_lock(lock_type& lock, std::uintptr_t e) {
  const std::shared_ptr<point> p = event_at(e, "synchronize_event");  // a copy: e may be re-recorded
  if (p == nullptr || p->done) return;
  const std::string call = "synchronize_event(" + std::to_string(e) + ")";
  auto pending = [&] {
    return static_cast<std::size_t>(p->ordinal - streams_.at(p->stream).completed);
  };
  if (std::string why = find_blocker(p->stream, pending()); !why.empty()) throw_blocked(call, why);
  auto why = [&] {
    std::string reason = find_blocker(p->stream, pending());
    return call + " on " + name_ + " would never return: " +
           (reason.empty() ? "its work cannot progress" : reason);
  };
  wait_until_releasing_lock(lock, [&] { return p->done; }, why);
}

void sim_scheduler::synchronize_device_releasing_lock(lock_type& lock) {
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> targets;
  for (const auto& [sid, s] : streams_) {
    if (s.ops.empty()) continue;
    if (std::string why = find_blocker(sid, s.ops.size()); !why.empty())
      throw_blocked("synchronize_device()", why);
    targets.emplace_back(sid, s.enqueued);
  }
  run_until_idle_releasing_lock(lock);
  for (const auto& [sid, target] : targets) {
    auto it = streams_.find(sid);
    if (it == streams_.end() || it->second.completed >= target) continue;
    std::string why = find_blocker(sid, static_cast<std::size_t>(target - it->second.completed));
    throw_blocked("synchronize_device()",
                  why.empty() ? "stream " + std::to_string(sid) +
                                    " waits for a kernel effect running on another thread"
                              : why);
  }
}

// --- diagnosis -------------------------------------------------------------------------------------

bool sim_scheduler::effect_running_here() const noexcept {
  return std::find(effect_threads_.begin(), effect_threads_.end(), std::this_thread::get_id()) !=
         effect_threads_.end();
}

bool sim_scheduler::effects_running_elsewhere() const noexcept {
  const auto me = std::this_thread::get_id();
  return std::any_of(effect_threads_.begin(), effect_threads_.end(),
                     [&](std::thread::id id) { return id != me; });
}

// Why the first `count` ops of stream `sid` can never complete, following waits to the streams
// they wait on; "" when nothing in the queued work says so.
std::string sim_scheduler::find_blocker(std::uintptr_t sid, std::size_t count) const {
  const auto me = std::this_thread::get_id();
  std::unordered_map<std::uintptr_t, std::size_t> scanned;  // per stream: ops already looked at
  std::vector<std::pair<std::uintptr_t, std::size_t>> todo{{sid, count}};
  while (!todo.empty()) {
    auto [id, n] = todo.back();
    todo.pop_back();
    auto it = streams_.find(id);
    if (it == streams_.end()) continue;
    const stream& s = it->second;
    n = std::min(n, s.ops.size());
    std::size_t& from = scanned[id];
    if (n <= from) continue;
    const std::string via = id == sid ? "" : " (waited on through an event)";
    if (s.held) return "stream " + std::to_string(id) + via + " is held; release() it first";
    if (s.head == head_state::in_effect && s.effect_thread == me)
      return "stream " + std::to_string(id) + via +
             " is running a kernel effect on this thread, which cannot wait for itself";
    for (std::size_t i = from; i < n; ++i) {
      const op& o = s.ops[i];
      if (o.kind != op_kind::wait || o.at->done) continue;
      auto on = streams_.find(o.at->stream);
      if (on != streams_.end())
        todo.emplace_back(o.at->stream, static_cast<std::size_t>(o.at->ordinal - on->second.completed));
    }
    from = n;
  }
  return {};
}

void sim_scheduler::throw_blocked(const std::string& call, const std::string& reason) const {
  throw std::logic_error(call + " on " + name_ + " would never return: " + reason);
}

}  // namespace spillway::detail
