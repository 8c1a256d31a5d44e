// trace_format: spillway's alloc/free trace in memory, and its text form on disk
// (docs/trace_format.md has the format; this is its one reader and writer in C++).
//
// Contract
// - A trace is a header (device capacity, source, PyTorch's peak reserved bytes when the trace was
//   recorded under PyTorch, other key=value pairs) and events in time order: alloc, free and
//   record_stream of small integer ids.
// - parse_trace / read_trace accept only valid traces: an unknown op, a free or record_stream of an
//   id that is not live, an alloc of an id that is live, time going backwards, a size of 0 or
//   above size_classes::max_request_size, a number that is negative, garbage or out of range, a
//   missing or wrong header -> spillway::invalid_argument naming the file, the line number and the
//   line's text. What they return can be replayed without further checks.
// - write_trace / to_text check the same rules before writing a byte (they never write a trace
//   that read_trace would refuse), and throw invalid_argument naming the event's index.
// - Files: read_trace reads plain text or gzip (recognised by its magic bytes, not by the name);
//   write_trace compresses when the path ends in ".gz". Compression runs the `gzip` program
//   (trace_gzip.hpp), so the tools need no compression library at build time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spillway::trace {

inline constexpr std::string_view magic = "spillway-trace";
inline constexpr int format_version = 1;
inline constexpr std::uint32_t max_id = (1u << 24) - 1;   // ids are small: reused after a free
inline constexpr std::uint32_t max_stream = 65535;

enum class op : char { alloc = 'a', free = 'f', record_stream = 'r' };

struct event {
  std::uint64_t t_ns = 0;     // nanoseconds since the start of the trace; never decreases
  std::uint64_t size = 0;     // alloc: the requested bytes; 0 otherwise
  std::uint32_t id = 0;       // live from its alloc to its free
  std::uint32_t stream = 0;   // alloc / free: the allocation's stream; record_stream: the user stream
  op kind = op::alloc;

  friend bool operator==(const event&, const event&) = default;
};

struct header {
  std::size_t device_capacity = 0;                  // bytes of the recording device; 0: unknown
  std::string source;                               // where it came from (no white space)
  std::optional<std::size_t> torch_peak_reserved;   // PyTorch's peak reserved bytes in the window
  std::vector<std::pair<std::string, std::string>> extra;  // other key=value pairs, in order

  friend bool operator==(const header&, const header&) = default;
};

struct trace_data {
  header head;
  std::vector<event> events;

  friend bool operator==(const trace_data&, const trace_data&) = default;
};

// What a trace asks of an allocator, independent of any allocator.
struct trace_summary {
  std::uint64_t events = 0, allocs = 0, frees = 0, record_streams = 0;
  std::uint64_t bytes_requested = 0;     // sum of alloc sizes
  std::uint64_t peak_live_bytes = 0;     // peak of the sum of live requested sizes
  std::uint64_t peak_live_allocations = 0;
  std::uint64_t live_at_end = 0;         // allocations never freed
  std::uint32_t id_limit = 0;            // 1 + the largest id
  std::uint32_t streams = 0;             // 1 + the largest stream
  std::uint64_t duration_ns = 0;         // time of the last event
};

// Parses the text of a trace; `name` (a file name) is used in error messages.
trace_data parse_trace(std::string_view text, const std::string& name = "trace");

// Reads a trace file, plain or gzip-compressed.
trace_data read_trace(const std::string& path);

// The text form of a trace (header line, then one event per line).
std::string to_text(const trace_data& trace);

// Writes a trace to `path`: gzip-compressed when the path ends in ".gz", plain text otherwise.
void write_trace(const trace_data& trace, const std::string& path);

trace_summary summarize(const trace_data& trace);

}  // namespace spillway::trace
