// text_lines: the pieces both trace readers (trace_format, op_trace) use to parse their
// line-oriented text formats, so that both report bad input the same way.
//
// - fail_at throws spillway::invalid_argument "<name>:<line>: <problem> in "<line text>"".
// - split_words splits on spaces and tabs (any number).
// - parse_uint reads an unsigned decimal number: no sign, fraction, exponent or hex.
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

}  // namespace spillway::bench::text
