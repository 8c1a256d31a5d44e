// trace_builder: id assignment and bookkeeping for traces built in code. Contract in
// trace_builder.hpp.
#include "trace_builder.hpp"

#include <stdexcept>
#include <string>

namespace spillway::trace {

std::uint32_t trace_builder::alloc(std::uint64_t bytes, std::uint32_t stream) {
  std::uint32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.top();
    free_ids_.pop();
  } else {
    id = static_cast<std::uint32_t>(stream_plus_one_.size());
    if (id > max_id) throw std::logic_error("trace_builder: more than max_id live allocations");
    stream_plus_one_.push_back(0);
    size_.push_back(0);
  }
  stream_plus_one_[id] = stream + 1;
  size_[id] = bytes;
  ++live_;
  live_bytes_ += bytes;
  trace_.events.push_back({now_ns_, bytes, id, stream, op::alloc});
  return id;
}

void trace_builder::free(std::uint32_t id) {
  if (id >= stream_plus_one_.size() || stream_plus_one_[id] == 0) {
    throw std::logic_error("trace_builder: free of id " + std::to_string(id) + ", which is not live");
  }
  trace_.events.push_back({now_ns_, 0, id, stream_plus_one_[id] - 1, op::free});
  stream_plus_one_[id] = 0;
  --live_;
  live_bytes_ -= size_[id];
  free_ids_.push(id);
}

void trace_builder::record_stream(std::uint32_t id, std::uint32_t stream) {
  if (id >= stream_plus_one_.size() || stream_plus_one_[id] == 0) {
    throw std::logic_error("trace_builder: record_stream of id " + std::to_string(id) +
                           ", which is not live");
  }
  trace_.events.push_back({now_ns_, 0, id, stream, op::record_stream});
}

trace_data trace_builder::finish() {
  trace_data out = std::move(trace_);
  trace_ = {};
  stream_plus_one_.clear();
  size_.clear();
  free_ids_ = {};
  live_ = 0;
  live_bytes_ = 0;
  now_ns_ = 0;
  return out;
}

}  // namespace spillway::trace
