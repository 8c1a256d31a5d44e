// text_lines.cpp: see text_lines.hpp.
#include "text_lines.hpp"

#include <charconv>

#include "spillway/errors.hpp"

namespace spillway::bench::text {

void fail_at(const std::string& name, std::size_t line_no, std::string_view line,
             const std::string& problem) {
  std::string shown(line.substr(0, 200));
  if (line.size() > 200) shown += "...";
  throw spillway::invalid_argument(name + ":" + std::to_string(line_no) + ": " + problem + " in \"" +
                                   shown + "\"");
}

std::vector<std::string_view> split_words(std::string_view line) {
  std::vector<std::string_view> words;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    const std::size_t b = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
    if (i > b) words.push_back(line.substr(b, i - b));
  }
  return words;
}

std::string parse_uint(std::string_view word, const char* what, std::uint64_t& out) {
  const auto quoted = [&] { return std::string(what) + " \"" + std::string(word) + "\""; };
  if (!word.empty() && word[0] == '-') return quoted() + " is negative";
  const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), out);
  if (ec == std::errc::result_out_of_range) return quoted() + " is out of range";
  if (ec != std::errc() || end != word.data() + word.size()) return quoted() + " is not a number";
  return "";
}

}  // namespace spillway::bench::text
