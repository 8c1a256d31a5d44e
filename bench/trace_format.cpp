// trace_format: the text trace reader and writer. The contract is in trace_format.hpp, the format
// in docs/trace_format.md.
#include "trace_format.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>

#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"
#include "text_lines.hpp"
#include "trace_gzip.hpp"

namespace spillway::trace {
namespace {

// The rules every event must follow, given the events before it. Shared by the reader and the
// writer, so that whatever is written can be read back.
class event_checker {
 public:
  // "" when `e` is valid after the events checked so far; otherwise what is wrong with it.
  std::string check(const event& e) {
    if (e.t_ns < last_t_) {
      return "time goes backwards (" + std::to_string(e.t_ns) + " ns after " +
             std::to_string(last_t_) + " ns)";
    }
    if (e.id > max_id) return "id " + std::to_string(e.id) + " is above the limit " + std::to_string(max_id);
    if (e.stream > max_stream) {
      return "stream " + std::to_string(e.stream) + " is above the limit " + std::to_string(max_stream);
    }
    if (e.id >= stream_plus_one_.size()) stream_plus_one_.resize(std::max<std::size_t>(e.id + 1, 2 * stream_plus_one_.size()), 0);
    std::uint32_t& live = stream_plus_one_[e.id];  // 0: not live; else 1 + the allocation's stream
    switch (e.kind) {
      case op::alloc:
        if (e.size == 0) return "an allocation of 0 bytes";
        if (e.size > size_classes::max_request_size) {
          return "size " + std::to_string(e.size) + " is above the largest request (" +
                 std::to_string(size_classes::max_request_size) + " bytes)";
        }
        if (live != 0) return "alloc of id " + std::to_string(e.id) + ", which is already live";
        live = e.stream + 1;
        break;
      case op::free:
        if (live == 0) return "free of id " + std::to_string(e.id) + ", which is not live";
        if (live != e.stream + 1) {
          return "free of id " + std::to_string(e.id) + " on stream " + std::to_string(e.stream) +
                 ", but it was allocated on stream " + std::to_string(live - 1);
        }
        live = 0;
        break;
      case op::record_stream:
        if (live == 0) return "record_stream of id " + std::to_string(e.id) + ", which is not live";
        break;
      default:
        return "unknown op '" + std::string(1, static_cast<char>(e.kind)) + "'";
    }
    last_t_ = e.t_ns;
    return "";
  }

 private:
  std::vector<std::uint32_t> stream_plus_one_;
  std::uint64_t last_t_ = 0;
};

// --- reading ---------------------------------------------------------------------------------

using bench::text::fail_at;
using bench::text::parse_uint;
using bench::text::split_words;

header parse_header(std::string_view line, const std::string& name) {
  const auto words = split_words(line);
  const std::string expected = "# " + std::string(magic) + " v" + std::to_string(format_version);
  if (words.size() < 2 || words[0] != "#" || words[1] != magic) {
    fail_at(name, 1, line, "not a spillway trace: the first line must start with \"" + expected + "\"");
  }
  if (words.size() < 3 || words[2] != "v" + std::to_string(format_version)) {
    fail_at(name, 1, line, "unsupported trace version (this reader reads v" +
                               std::to_string(format_version) + ")");
  }
  header h;
  for (std::size_t i = 3; i < words.size(); ++i) {
    const auto eq = words[i].find('=');
    if (eq == std::string_view::npos || eq == 0) {
      fail_at(name, 1, line, "header field \"" + std::string(words[i]) + "\" is not key=value");
    }
    const std::string key(words[i].substr(0, eq));
    const std::string value(words[i].substr(eq + 1));
    std::uint64_t n = 0;
    if (key == "device_capacity" || key == "torch_peak_reserved") {
      if (auto problem = parse_uint(value, key.c_str(), n); !problem.empty()) fail_at(name, 1, line, problem);
      if (key == "device_capacity") {
        h.device_capacity = n;
      } else {
        h.torch_peak_reserved = n;
      }
    } else if (key == "source") {
      h.source = value;
    } else {
      h.extra.emplace_back(key, value);
    }
  }
  return h;
}

event parse_event(const std::vector<std::string_view>& w, const std::string& name, std::size_t line_no,
                  std::string_view line) {
  if (w.size() < 2 || w[1].size() != 1) fail_at(name, line_no, line, "expected \"<t_ns> <op> ...\"");
  event e;
  const char kind = w[1][0];
  const std::size_t fields = kind == 'a' ? 5 : 4;
  if (kind != 'a' && kind != 'f' && kind != 'r') {
    fail_at(name, line_no, line, "unknown op \"" + std::string(w[1]) + "\" (expected a, f or r)");
  }
  if (w.size() != fields) {
    fail_at(name, line_no, line, std::string("op ") + kind + " takes " + std::to_string(fields) +
                                     " fields, found " + std::to_string(w.size()));
  }
  e.kind = static_cast<op>(kind);
  std::uint64_t id = 0, stream = 0;
  std::string problem = parse_uint(w[0], "time", e.t_ns);
  if (problem.empty()) problem = parse_uint(w[2], "id", id);
  if (problem.empty() && kind == 'a') problem = parse_uint(w[3], "size", e.size);
  if (problem.empty()) problem = parse_uint(w[fields - 1], "stream", stream);
  if (problem.empty() && id > max_id) problem = "id " + std::string(w[2]) + " is above the limit " + std::to_string(max_id);
  if (problem.empty() && stream > max_stream) {
    problem = "stream " + std::string(w[fields - 1]) + " is above the limit " + std::to_string(max_stream);
  }
  if (!problem.empty()) fail_at(name, line_no, line, problem);
  e.id = static_cast<std::uint32_t>(id);
  e.stream = static_cast<std::uint32_t>(stream);
  return e;
}

// --- writing ---------------------------------------------------------------------------------

void check_token(const std::string& what, const std::string& s, bool is_key) {
  const bool bad = (is_key && (s.empty() || s.find('=') != std::string::npos)) ||
                   std::any_of(s.begin(), s.end(), [](char c) {
                     return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\0';
                   });
  if (bad) {
    throw spillway::invalid_argument("trace header " + what + " \"" + s +
                                     "\" must be a single word (no white space" +
                                     (is_key ? ", no '=', not empty)" : ")"));
  }
}

void append_uint(std::string& out, std::uint64_t v) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, end);
}

}  // namespace

trace_data parse_trace(std::string_view text, const std::string& name) {
  trace_data trace;
  event_checker checker;
  bool have_header = false;
  bench::text::for_each_line(text, [&](std::size_t line_no, std::string_view line) {
    if (!have_header) {
      trace.head = parse_header(line, name);
      have_header = true;
      return;
    }
    const auto words = split_words(line);
    if (words.empty() || words[0][0] == '#') return;  // blank line or comment
    const event e = parse_event(words, name, line_no, line);
    if (auto problem = checker.check(e); !problem.empty()) fail_at(name, line_no, line, problem);
    trace.events.push_back(e);
  });
  if (!have_header) fail_at(name, 1, "", "empty file: a trace starts with a \"# spillway-trace v1\" line");
  return trace;
}

trace_data read_trace(const std::string& path) {
  if (is_gzip_file(path)) return parse_trace(gunzip_file(path), path);
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw spillway::invalid_argument("cannot read trace file \"" + path + "\"");
  return parse_trace(text, path);
}

std::string to_text(const trace_data& trace) {
  const header& h = trace.head;
  check_token("source", h.source, false);
  std::string out = "# " + std::string(magic) + " v" + std::to_string(format_version) +
                    " device_capacity=" + std::to_string(h.device_capacity) +
                    " source=" + (h.source.empty() ? "unknown" : h.source);
  if (h.torch_peak_reserved) out += " torch_peak_reserved=" + std::to_string(*h.torch_peak_reserved);
  for (const auto& [k, v] : h.extra) {
    check_token("key", k, true);
    check_token("value", v, false);
    if (k == "device_capacity" || k == "source" || k == "torch_peak_reserved") {
      throw spillway::invalid_argument("trace header key \"" + k + "\" belongs in its own field, not in extra");
    }
    out += " " + k + "=" + v;
  }
  out += '\n';

  event_checker checker;
  out.reserve(out.size() + trace.events.size() * 24);
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const event& e = trace.events[i];
    if (auto problem = checker.check(e); !problem.empty()) {
      throw spillway::invalid_argument("trace event " + std::to_string(i) + ": " + problem);
    }
    append_uint(out, e.t_ns);
    out += ' ';
    out += static_cast<char>(e.kind);
    out += ' ';
    append_uint(out, e.id);
    out += ' ';
    if (e.kind == op::alloc) {
      append_uint(out, e.size);
      out += ' ';
    }
    append_uint(out, e.stream);
    out += '\n';
  }
  return out;
}

void write_trace(const trace_data& trace, const std::string& path) {
  write_text_file(path, to_text(trace), "trace file");
}

trace_summary summarize(const trace_data& trace) {
  trace_summary s;
  std::vector<std::uint64_t> size_of;
  std::uint64_t live_bytes = 0, live = 0;
  for (const event& e : trace.events) {
    ++s.events;
    s.id_limit = std::max(s.id_limit, e.id + 1);
    s.streams = std::max(s.streams, e.stream + 1);
    s.duration_ns = e.t_ns;
    if (e.id >= size_of.size()) size_of.resize(e.id + 1, 0);
    switch (e.kind) {
      case op::alloc:
        ++s.allocs;
        s.bytes_requested += e.size;
        size_of[e.id] = e.size;
        live_bytes += e.size;
        ++live;
        s.peak_live_bytes = std::max(s.peak_live_bytes, live_bytes);
        s.peak_live_allocations = std::max(s.peak_live_allocations, live);
        break;
      case op::free:
        ++s.frees;
        live_bytes -= size_of[e.id];
        --live;
        break;
      case op::record_stream:
        ++s.record_streams;
        break;
    }
  }
  s.live_at_end = live;
  return s;
}

}  // namespace spillway::trace
