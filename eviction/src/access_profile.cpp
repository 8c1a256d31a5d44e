// access_profile.cpp: the record of one step's reads, and predictions from the last step's.
#include "access_profile.hpp"

#include <algorithm>

namespace spillway::eviction::detail {

// The record becomes the profile: its reads, sorted by key with a counting sort (the record is in
// event order, so each key's events come out ascending), and its event times and key sizes. Built
// aside and swapped in: a step whose memory runs out keeps the last profile whole (Note [Host out
// of memory]).
void access_profile::begin_step(std::uint64_t now_ns) {
  if (steps_ > 0) {
    const std::size_t keys = record_.sizes.size();
    std::vector<std::uint32_t> first(keys + 1, 0);
    for (std::uint64_t r : record_.reads) ++first[(r >> 32) + 1];
    for (std::size_t k = 0; k < keys; ++k) first[k + 1] += first[k];
    scratch_.assign(first.begin(), first.end() - 1);
    std::vector<std::uint32_t> events(record_.reads.size());
    for (std::uint64_t r : record_.reads) {
      events[scratch_[r >> 32]++] = static_cast<std::uint32_t>(r & 0xffffffffu);
    }
    std::vector<bool> diverged(keys, false);
    // Nothing below allocates.
    profile_.first.swap(first);
    profile_.events.swap(events);
    std::swap(profile_.event_ns, record_.event_ns);
    std::swap(profile_.sizes, record_.sizes);
    diverged_.swap(diverged);
  }
  record_.event_ns.clear();
  record_.reads.clear();
  record_.sizes.clear();
  ++steps_;
  step_start_ns_ = now_ns;
  event_ = no_key;
}

access_profile::step_key access_profile::on_register(std::size_t size) {
  if (steps_ == 0 || record_.sizes.size() >= no_key) return {};
  record_.sizes.push_back(size);
  return {steps_, static_cast<std::uint32_t>(record_.sizes.size() - 1)};
}

void access_profile::begin_event(std::uint64_t now_ns) {
  if (steps_ == 0 || record_.event_ns.size() >= no_key) return;
  record_.event_ns.push_back(now_ns > step_start_ns_ ? now_ns - step_start_ns_ : 0);
  event_ = static_cast<std::uint32_t>(record_.event_ns.size() - 1);
}

void access_profile::on_read(step_key key) {
  if (key.step != steps_ || key.ordinal == no_key || event_ == no_key) return;
  record_.reads.push_back(static_cast<std::uint64_t>(key.ordinal) << 32 | event_);
  if (predicting() && !recorded_read(key.ordinal, event_)) {
    ++mismatches_;
    if (key.ordinal < diverged_.size()) diverged_[key.ordinal] = true;
  }
}

bool access_profile::recorded_read(std::uint32_t key, std::uint32_t event) const noexcept {
  if (key + std::size_t{1} >= profile_.first.size()) return false;
  const auto begin = profile_.events.begin() + profile_.first[key];
  const auto end = profile_.events.begin() + profile_.first[key + 1];
  return std::binary_search(begin, end, event);
}

std::uint32_t access_profile::next_read(step_key key, std::size_t size) const noexcept {
  if (!predicting() || key.step != steps_ || key.ordinal == no_key) return no_event;
  if (key.ordinal + std::size_t{1} >= profile_.first.size() || profile_.sizes[key.ordinal] != size ||
      diverged_[key.ordinal]) {
    return no_event;
  }
  const auto begin = profile_.events.begin() + profile_.first[key.ordinal];
  const auto end = profile_.events.begin() + profile_.first[key.ordinal + 1];
  // Before the step's first event, its first read; after, the first read after the current event.
  const auto next = event_ == no_key ? begin : std::upper_bound(begin, end, event_);
  return next == end ? beyond_step : *next;
}

double access_profile::distance_ns(std::uint32_t next_read) const noexcept {
  constexpr double unknown = std::numeric_limits<double>::quiet_NaN();
  const std::size_t recorded = profile_.event_ns.size();
  const bool started = event_ != no_key;  // before the step's first event: at the step's start
  if (next_read == no_event || (started && event_ >= recorded)) return unknown;
  const std::uint64_t now = started ? profile_.event_ns[event_] : 0;
  if (next_read == beyond_step) {  // as if read at the same point of the next step
    if (recorded == 0) return unknown;  // a step with registrations and no read: no span
    const std::uint64_t span = profile_.event_ns.back();
    return static_cast<double>(span - now + span) + 1.0;
  }
  if ((started && next_read <= event_) || next_read >= recorded) return unknown;
  const std::uint64_t then = profile_.event_ns[next_read];
  return std::max(1.0, static_cast<double>(then > now ? then - now : 0));
}

}  // namespace spillway::eviction::detail
