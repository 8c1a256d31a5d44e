// text_lines: the pieces both trace readers (trace_format, op_trace) use to parse their
// line-oriented text formats, so that both report bad input the same way.
//
// - fail_at throws spillway::invalid_argument "<name>:<line>: <problem> in "<line text>"".
// - split_words splits on spaces and tabs (any number).
// - parse_uint reads an unsigned decimal number: no sign, fraction, exponent or hex.
// - for_each_line calls f(line_no, line) for every line (1-based, a trailing \r removed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spillway::bench::text {

[[noreturn]] void fail_at(const std::string& name, std::size_t line_no, std::string_view line,
                          const std::string& problem);

std::vector<std::string_view> split_words(std::string_view line);

// "" on success, else the problem, naming `what` and the word.
std::string parse_uint(std::string_view word, const char* what, std::uint64_t& out);

template <class F>
void for_each_line(std::string_view text, F&& f) {
  std::size_t line_no = 0, pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(++line_no, line);
  }
}

}  // namespace spillway::bench::text
