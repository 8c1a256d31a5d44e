// op_trace: the operator trace reader and writer. The contract is in op_trace.hpp, the format in
// docs/op_trace_format.md.
#include "op_trace.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <unordered_map>

#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"
#include "text_lines.hpp"
#include "trace_gzip.hpp"

namespace spillway::op_trace {
namespace {

using bench::text::fail_at;
using bench::text::parse_uint;
using bench::text::split_words;

bool is_word(const std::string& s) {
  return !s.empty() && std::none_of(s.begin(), s.end(), [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\0';
  });
}

// What the reader knows about one buffer while it reads; also used by the writer's check.
struct buffer_state {
  bool written = false;          // an op wrote it
  bool freed = false;
  std::size_t first_read = never;  // op index of its first read before any write
};

// The single-assignment rules, shared by the reader and the writer so that whatever is written
// can be read back. Each check returns "" or the problem.
class rules {
 public:
  // `buffers` may grow between checks (b lines between ops).
  explicit rules(const std::vector<buffer>& buffers) : buffers_(buffers) {}

  std::string check_op(const op& o, std::size_t index) {
    state_.resize(buffers_.size());
    for (std::size_t i = 0; i < o.inputs.size(); ++i) {
      const std::uint32_t b = o.inputs[i];
      if (std::find(o.inputs.begin(), o.inputs.begin() + i, b) != o.inputs.begin() + i) {
        return "buffer " + id(b) + " is listed twice as an input";
      }
      buffer_state& s = state_[b];
      if (s.freed) return "buffer " + id(b) + " is read after its free";
      if (!s.written && !buffers_[b].param) {
        return "buffer " + id(b) + " is read before any op writes it (declare it `param` if it is a weight or input)";
      }
      if (!s.written && s.first_read == never) s.first_read = index;
    }
    for (std::size_t i = 0; i < o.outputs.size(); ++i) {
      const std::uint32_t b = o.outputs[i];
      if (std::find(o.outputs.begin(), o.outputs.begin() + i, b) != o.outputs.begin() + i) {
        return "buffer " + id(b) + " is listed twice as an output";
      }
      if (std::find(o.inputs.begin(), o.inputs.end(), b) != o.inputs.end()) {
        return "buffer " + id(b) + " is both read and written (give the new value a new id)";
      }
      buffer_state& s = state_[b];
      if (s.written) return "buffer " + id(b) + " is written a second time (give the new value a new id)";
      if (s.freed) return "buffer " + id(b) + " is written after its free";
      if (s.first_read != never) {
        return "parameter " + id(b) + " is written by this op but was read before (by op " +
               std::to_string(s.first_read) + "), so it existed from the start";
      }
      s.written = true;
    }
    return "";
  }

  std::string check_free(std::uint32_t b, std::size_t ops_so_far) {
    state_.resize(buffers_.size());
    if (ops_so_far == 0) return "a free before the first op";
    buffer_state& s = state_[b];
    if (s.freed) return "buffer " + id(b) + " is freed twice";
    if (!s.written && !buffers_[b].param) return "buffer " + id(b) + " is freed before any op writes it";
    s.freed = true;
    return "";
  }

 private:
  std::string id(std::uint32_t b) const { return std::to_string(buffers_[b].file_id); }
  const std::vector<buffer>& buffers_;
  std::vector<buffer_state> state_;
};

struct reader {
  const std::string& name;
  trace_data trace;
  std::unordered_map<std::uint64_t, std::uint32_t> index_of;  // file id -> buffer index

  std::uint32_t lookup(std::string_view word, std::size_t line_no, std::string_view line) {
    std::uint64_t fid = 0;
    if (auto problem = parse_uint(word, "buffer id", fid); !problem.empty()) fail_at(name, line_no, line, problem);
    const auto it = index_of.find(fid);
    if (it == index_of.end()) fail_at(name, line_no, line, "buffer " + std::to_string(fid) + " is not declared (no `b` line before)");
    return it->second;
  }

  void header(std::string_view line) {
    const auto w = split_words(line);
    const std::string expected = "# " + std::string(magic) + " v" + std::to_string(format_version);
    if (w.size() < 2 || w[0] != "#" || w[1] != magic) {
      fail_at(name, 1, line, "not an op trace: the first line must start with \"" + expected + "\"");
    }
    if (w.size() < 3 || w[2] != "v" + std::to_string(format_version)) {
      fail_at(name, 1, line, "unsupported op trace version (this reader reads v" + std::to_string(format_version) + ")");
    }
    for (std::size_t i = 3; i < w.size(); ++i) {
      const auto eq = w[i].find('=');
      if (eq == std::string_view::npos || eq == 0) {
        fail_at(name, 1, line, "header field \"" + std::string(w[i]) + "\" is not key=value");
      }
      std::string key(w[i].substr(0, eq)), value(w[i].substr(eq + 1));
      if (key == "model") {
        trace.model = value;
      } else if (key == "source") {
        trace.source = value;
      } else {
        trace.extra.emplace_back(std::move(key), std::move(value));
      }
    }
  }

  void buffer_line(const std::vector<std::string_view>& w, std::size_t line_no, std::string_view line) {
    if (w.size() != 3 && !(w.size() == 4 && w[3] == "param")) {
      fail_at(name, line_no, line, "expected \"b <id> <bytes> [param]\"");
    }
    buffer b;
    if (auto p = parse_uint(w[1], "buffer id", b.file_id); !p.empty()) fail_at(name, line_no, line, p);
    if (auto p = parse_uint(w[2], "size", b.bytes); !p.empty()) fail_at(name, line_no, line, p);
    if (b.bytes == 0) fail_at(name, line_no, line, "buffer " + std::to_string(b.file_id) + " has 0 bytes");
    if (b.bytes > size_classes::max_request_size) {
      fail_at(name, line_no, line, "size " + std::to_string(b.bytes) + " is above the largest request (" +
                                       std::to_string(size_classes::max_request_size) + " bytes)");
    }
    b.param = w.size() == 4;
    if (!index_of.emplace(b.file_id, static_cast<std::uint32_t>(trace.buffers.size())).second) {
      fail_at(name, line_no, line, "buffer " + std::to_string(b.file_id) + " is declared twice");
    }
    trace.buffers.push_back(b);
  }

  op op_line(const std::vector<std::string_view>& w, std::size_t line_no, std::string_view line) {
    // o <name> <duration_ns> in <ids...> out <ids...>
    const auto in_at = std::find(w.begin(), w.end(), std::string_view("in"));
    const auto out_at = std::find(w.begin(), w.end(), std::string_view("out"));
    if (w.size() < 5 || in_at != w.begin() + 3 || out_at == w.end()) {
      fail_at(name, line_no, line, "expected \"o <name> <duration_ns> in <ids...> out <ids...>\"");
    }
    op o;
    o.name = std::string(w[1]);
    if (auto p = parse_uint(w[2], "duration", o.duration_ns); !p.empty()) fail_at(name, line_no, line, p);
    for (auto it = in_at + 1; it != out_at; ++it) o.inputs.push_back(lookup(*it, line_no, line));
    for (auto it = out_at + 1; it != w.end(); ++it) o.outputs.push_back(lookup(*it, line_no, line));
    return o;
  }
};

void append_uint(std::string& out, std::uint64_t v) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, end);
}

}  // namespace

std::size_t trace_data::backward_begin() const noexcept {
  for (const phase_mark& p : phases) {
    if (p.name == "backward") return p.first_op;
  }
  return ops.size();
}

trace_data parse_op_trace(std::string_view text, const std::string& name) {
  reader r{name, {}, {}};
  rules check(r.trace.buffers);
  bool have_header = false;
  bench::text::for_each_line(text, [&](std::size_t line_no, std::string_view line) {
    if (!have_header) {
      r.header(line);
      have_header = true;
      return;
    }
    const auto w = split_words(line);
    if (w.empty() || w[0][0] == '#') return;  // blank line or comment
    if (w[0] == "b") {
      r.buffer_line(w, line_no, line);
    } else if (w[0] == "o") {
      op o = r.op_line(w, line_no, line);
      if (auto p = check.check_op(o, r.trace.ops.size()); !p.empty()) fail_at(name, line_no, line, p);
      r.trace.ops.push_back(std::move(o));
    } else if (w[0] == "f") {
      if (w.size() != 2) fail_at(name, line_no, line, "expected \"f <id>\"");
      const std::uint32_t b = r.lookup(w[1], line_no, line);
      if (auto p = check.check_free(b, r.trace.ops.size()); !p.empty()) fail_at(name, line_no, line, p);
      r.trace.buffers[b].free_after = r.trace.ops.size() - 1;
    } else if (w[0] == "phase") {
      if (w.size() != 2) fail_at(name, line_no, line, "expected \"phase <name>\"");
      r.trace.phases.push_back({r.trace.ops.size(), std::string(w[1])});
    } else {
      fail_at(name, line_no, line, "unknown line \"" + std::string(w[0]) + "\" (expected b, o, f, phase or #)");
    }
  });
  if (!have_header) fail_at(name, 1, "", "empty file: an op trace starts with a \"# spillway-op-trace v1\" line");
  return std::move(r.trace);
}

trace_data read_op_trace(const std::string& path) {
  if (trace::is_gzip_file(path)) return parse_op_trace(trace::gunzip_file(path), path);
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw spillway::invalid_argument("cannot read op trace file \"" + path + "\"");
  return parse_op_trace(text, path);
}

std::string to_text(const trace_data& t) {
  const auto word = [](const std::string& what, const std::string& s) {
    if (!is_word(s)) throw spillway::invalid_argument("op trace " + what + " \"" + s + "\" must be one word (no white space)");
  };
  word("model", t.model);
  word("source", t.source);
  std::string out = "# " + std::string(magic) + " v" + std::to_string(format_version) + " model=" + t.model +
                    " source=" + t.source;
  for (const auto& [k, v] : t.extra) {
    word("header key", k);
    word("header value", v);
    if (k.find('=') != std::string::npos || k == "model" || k == "source") {
      throw spillway::invalid_argument("op trace header key \"" + k + "\" is not allowed in extra");
    }
    out += " " + k + "=" + v;
  }
  out += '\n';

  std::unordered_map<std::uint64_t, bool> seen;
  for (const buffer& b : t.buffers) {
    if (!seen.emplace(b.file_id, true).second) {
      throw spillway::invalid_argument("op trace: buffer id " + std::to_string(b.file_id) + " is used twice");
    }
    if (b.bytes == 0 || b.bytes > size_classes::max_request_size) {
      throw spillway::invalid_argument("op trace: buffer " + std::to_string(b.file_id) + " has " +
                                       std::to_string(b.bytes) + " bytes");
    }
    out += "b ";
    append_uint(out, b.file_id);
    out += ' ';
    append_uint(out, b.bytes);
    out += b.param ? " param\n" : "\n";
  }

  // Frees by op, in buffer order (the order the reader gives back).
  std::vector<std::vector<std::uint32_t>> frees(t.ops.size());
  for (std::size_t b = 0; b < t.buffers.size(); ++b) {
    const std::size_t k = t.buffers[b].free_after;
    if (k == never) continue;
    if (k >= t.ops.size()) throw spillway::invalid_argument("op trace: buffer " + std::to_string(t.buffers[b].file_id) + " is freed after op " + std::to_string(k) + ", which does not exist");
    frees[k].push_back(static_cast<std::uint32_t>(b));
  }
  rules check(t.buffers);
  std::size_t phase = 0;
  for (std::size_t k = 0; k <= t.ops.size(); ++k) {
    for (; phase < t.phases.size() && t.phases[phase].first_op <= k; ++phase) {
      if (t.phases[phase].first_op != k) throw spillway::invalid_argument("op trace: phases are not in op order");
      word("phase", t.phases[phase].name);
      out += "phase " + t.phases[phase].name + "\n";
    }
    if (k == t.ops.size()) break;
    const op& o = t.ops[k];
    word("op name", o.name);
    for (std::uint32_t b : o.inputs) {
      if (b >= t.buffers.size()) throw spillway::invalid_argument("op trace: op " + std::to_string(k) + " reads buffer index " + std::to_string(b) + ", out of range");
    }
    for (std::uint32_t b : o.outputs) {
      if (b >= t.buffers.size()) throw spillway::invalid_argument("op trace: op " + std::to_string(k) + " writes buffer index " + std::to_string(b) + ", out of range");
    }
    if (auto p = check.check_op(o, k); !p.empty()) {
      throw spillway::invalid_argument("op trace: op " + std::to_string(k) + " (" + o.name + "): " + p);
    }
    out += "o " + o.name + ' ';
    append_uint(out, o.duration_ns);
    out += " in";
    for (std::uint32_t b : o.inputs) {
      out += ' ';
      append_uint(out, t.buffers[b].file_id);
    }
    out += " out";
    for (std::uint32_t b : o.outputs) {
      out += ' ';
      append_uint(out, t.buffers[b].file_id);
    }
    out += '\n';
    for (std::uint32_t b : frees[k]) {
      if (auto p = check.check_free(b, k + 1); !p.empty()) throw spillway::invalid_argument("op trace: after op " + std::to_string(k) + ": " + p);
      out += "f ";
      append_uint(out, t.buffers[b].file_id);
      out += '\n';
    }
  }
  if (phase != t.phases.size()) throw spillway::invalid_argument("op trace: a phase starts after the last op + 1");
  return out;
}

void write_op_trace(const trace_data& t, const std::string& path) {
  trace::write_text_file(path, to_text(t), "op trace file");
}

liveness compute_liveness(const trace_data& t) {
  liveness l;
  const std::size_t n = t.buffers.size();
  l.produced_by.assign(n, never);
  l.last_use.assign(n, never);
  l.dies_after.assign(n, never);
  for (std::size_t k = 0; k < t.ops.size(); ++k) {
    for (std::uint32_t b : t.ops[k].inputs) l.last_use[b] = k;
    for (std::uint32_t b : t.ops[k].outputs) {
      l.last_use[b] = k;
      l.produced_by[b] = k;
    }
  }
  for (std::size_t b = 0; b < n; ++b) {
    if (t.buffers[b].free_after != never) {
      l.dies_after[b] = t.buffers[b].free_after;
    } else if (!t.buffers[b].param) {
      l.dies_after[b] = l.last_use[b];  // never when unused: it is never allocated
    }
  }
  return l;
}

trace_summary summarize(const trace_data& t) {
  trace_summary s;
  const liveness l = compute_liveness(t);
  s.ops = t.ops.size();
  s.buffers = t.buffers.size();
  const std::size_t backward = t.backward_begin();
  std::uint64_t live = 0;
  std::size_t live_n = 0;
  std::vector<std::vector<std::uint32_t>> dying(t.ops.size());
  for (std::size_t b = 0; b < t.buffers.size(); ++b) {
    if (t.buffers[b].param) {
      ++s.params;
      s.param_bytes += t.buffers[b].bytes;
      if (l.produced_by[b] == never) {
        live += t.buffers[b].bytes;
        ++live_n;
      }
    }
    if (l.dies_after[b] != never && (l.produced_by[b] != never || t.buffers[b].param)) dying[l.dies_after[b]].push_back(static_cast<std::uint32_t>(b));
  }
  s.peak_live_bytes = live;
  s.peak_live_buffers = live_n;
  for (std::size_t k = 0; k < t.ops.size(); ++k) {
    const op& o = t.ops[k];
    s.total_duration_ns += o.duration_ns;
    if (k < backward) {
      ++s.forward_ops;
      s.forward_duration_ns += o.duration_ns;
    } else {
      ++s.backward_ops;
    }
    for (std::uint32_t b : o.outputs) {
      live += t.buffers[b].bytes;
      ++live_n;
    }
    s.peak_live_bytes = std::max(s.peak_live_bytes, live);
    s.peak_live_buffers = std::max(s.peak_live_buffers, live_n);
    for (std::uint32_t b : dying[k]) {
      live -= t.buffers[b].bytes;
      --live_n;
    }
  }
  return s;
}

}  // namespace spillway::op_trace
