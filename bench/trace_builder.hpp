// trace_builder: writes a trace event by event, the way a program would allocate: it hands out
// ids (the lowest free one, so ids stay small), keeps the clock, and remembers each id's stream.
// Used by the synthetic workload models (trace_models.hpp) and by tests.
//
// Contract
// - alloc returns the new id; free / record_stream take an id that alloc returned and that is
//   still live (anything else is a bug in the caller: std::logic_error).
// - Time only moves through advance(); every event is stamped with the current time.
// - finish() hands over the trace; the builder is empty afterwards.
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

#include "trace_format.hpp"

namespace spillway::trace {

class trace_builder {
 public:
  explicit trace_builder(header head) { trace_.head = std::move(head); }

  std::uint32_t alloc(std::uint64_t bytes, std::uint32_t stream = 0);
  void free(std::uint32_t id);
  void record_stream(std::uint32_t id, std::uint32_t stream);
  void advance(std::uint64_t ns) noexcept { now_ns_ += ns; }

  std::uint64_t now_ns() const noexcept { return now_ns_; }
  std::size_t live_count() const noexcept { return live_; }
  std::uint64_t live_bytes() const noexcept { return live_bytes_; }
  std::uint64_t size_of(std::uint32_t id) const { return size_.at(id); }
  trace_data finish();

 private:
  trace_data trace_;
  std::uint64_t now_ns_ = 0;
  std::vector<std::uint32_t> stream_plus_one_;  // per id: 0 when not live
  std::vector<std::uint64_t> size_;
  std::priority_queue<std::uint32_t, std::vector<std::uint32_t>, std::greater<>> free_ids_;
  std::size_t live_ = 0;
  std::uint64_t live_bytes_ = 0;
};

}  // namespace spillway::trace
