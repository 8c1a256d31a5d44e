// op_trace: spillway's operator trace in memory, and its text form on disk
// (docs/op_trace_format.md has the format; this is its one reader and writer in C++).
//
// An operator trace is what the eviction simulator replays: the buffers of one training step
// (their sizes, which are parameters or inputs and never evictable) and the operators in program
// order, each with its duration, the buffers it reads and the buffers it writes. Every buffer that
// is not a parameter is written by exactly one op (single assignment: a recorder gives an in-place
// update a new buffer id). A buffer dies at its explicit free, or else after its last use.
//
// Contract
// - parse_op_trace / read_op_trace accept only valid traces. Anything else -> spillway::invalid_argument
//   naming the file, the line number and the line's text: an unknown line, a bad or out-of-range
//   number, a buffer declared twice, used before it is declared, read before an op writes it, written
//   twice, read or freed after its free, a size of 0 or above size_classes::max_request_size, an op
//   reading and writing the same buffer, a missing or wrong header. What they return can be replayed
//   without further checks.
// - to_text / write_op_trace write what the reader accepts (checked before a byte is written), and
//   parse_op_trace(to_text(t)) == t.
// - Files: plain text or gzip (by magic bytes); written gzip-compressed when the path ends in ".gz"
//   (trace_gzip.hpp: the `gzip` program, no library).
// - Buffers are stored densely, in declaration order; ops refer to them by index. The ids of the file
//   are kept (buffer::file_id) for messages and for writing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spillway::op_trace {

inline constexpr std::string_view magic = "spillway-op-trace";
inline constexpr int format_version = 1;
inline constexpr std::size_t never = static_cast<std::size_t>(-1);  // "no op" in op indices

struct buffer {
  std::uint64_t file_id = 0;   // its id in the file
  std::uint64_t bytes = 0;
  bool param = false;          // never evictable; without a producing op it exists from the start
  std::size_t free_after = never;  // op index after which an `f` line frees it; never: no `f`

  friend bool operator==(const buffer&, const buffer&) = default;
};

struct op {
  std::string name;                  // one word, e.g. "aten.addmm.default" or "fc3.bwd"
  std::uint64_t duration_ns = 0;
  std::vector<std::uint32_t> inputs;   // buffer indices, distinct
  std::vector<std::uint32_t> outputs;  // buffer indices, distinct, each written by this op only

  friend bool operator==(const op&, const op&) = default;
};

struct phase_mark {
  std::size_t first_op = 0;  // the phase starts before this op
  std::string name;          // "backward", "optimizer", ... (one word)

  friend bool operator==(const phase_mark&, const phase_mark&) = default;
};

struct trace_data {
  std::string model = "unknown";   // header model=...
  std::string source = "unknown";  // header source=...
  std::vector<std::pair<std::string, std::string>> extra;  // other header key=value pairs, in order
  std::vector<buffer> buffers;
  std::vector<op> ops;
  std::vector<phase_mark> phases;  // in op order

  // The index of the first op of the backward phase (ops.size() when there is none).
  std::size_t backward_begin() const noexcept;

  friend bool operator==(const trace_data&, const trace_data&) = default;
};

// When each buffer exists, as the simulator replays it.
struct liveness {
  std::vector<std::size_t> produced_by;  // op index, or never (a parameter that exists from the start)
  std::vector<std::size_t> last_use;     // last op that reads or writes it (never: unused)
  // The op after which it is released: its `f` line; else, for a buffer that is not a parameter,
  // its last use; else never (parameters live to the end).
  std::vector<std::size_t> dies_after;
};

struct trace_summary {
  std::size_t ops = 0, forward_ops = 0, backward_ops = 0;
  std::size_t buffers = 0, params = 0;
  std::uint64_t param_bytes = 0;       // bytes of parameters (initial and produced)
  std::uint64_t total_duration_ns = 0; // sum of op durations
  std::uint64_t forward_duration_ns = 0;
  std::uint64_t peak_live_bytes = 0;   // peak of the sum of live buffer sizes (no rounding)
  std::size_t peak_live_buffers = 0;
};

// Parses the text of a trace; `name` (a file name) is used in error messages.
trace_data parse_op_trace(std::string_view text, const std::string& name = "op-trace");
trace_data read_op_trace(const std::string& path);  // plain or gzip
std::string to_text(const trace_data& trace);
void write_op_trace(const trace_data& trace, const std::string& path);

liveness compute_liveness(const trace_data& trace);
trace_summary summarize(const trace_data& trace);

}  // namespace spillway::op_trace
