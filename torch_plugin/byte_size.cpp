// byte_size.cpp: parse_bytes. The contract is in byte_size.hpp.
#include "byte_size.hpp"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <string>

#include "spillway/errors.hpp"

namespace spillway {
namespace {

constexpr const char* accepted_sizes =
    "expected a number with an optional exponent and unit: B; KiB, MiB, GiB, TiB (binary); "
    "KB, MB, GB, TB (decimal); k, m, g, t (binary shorthand), e.g. 512MiB, 1.5GiB, 4k, 1e9";

[[noreturn]] void bad_size(std::string_view text, const std::string& why) {
  throw invalid_argument("invalid size \"" + std::string(text) + "\": " + why + "; " + accepted_sizes);
}

// The multiplier of a unit, or 0 when the unit is unknown.
std::uint64_t unit_multiplier(std::string_view unit) {
  constexpr std::uint64_t ki = 1024;
  if (unit.empty() || unit == "B" || unit == "b") return 1;
  if (unit == "KiB") return ki;
  if (unit == "MiB") return ki * ki;
  if (unit == "GiB") return ki * ki * ki;
  if (unit == "TiB") return ki * ki * ki * ki;
  if (unit == "KB" || unit == "kB") return 1000;
  if (unit == "MB") return 1000ull * 1000;
  if (unit == "GB") return 1000ull * 1000 * 1000;
  if (unit == "TB") return 1000ull * 1000 * 1000 * 1000;
  if (unit.size() == 1) {
    switch (unit[0]) {
      case 'k': case 'K': return ki;
      case 'm': case 'M': return ki * ki;
      case 'g': case 'G': return ki * ki * ki;
      case 't': case 'T': return ki * ki * ki * ki;
      default: break;
    }
  }
  return 0;
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string_view take_digits(std::string_view s, std::size_t& i) {
  const std::size_t begin = i;
  while (i < s.size() && is_digit(s[i])) ++i;
  return s.substr(begin, i - begin);
}

}  // namespace

std::size_t parse_bytes(std::string_view text) {
  const std::string_view s = trim(text);
  if (s.empty()) bad_size(text, "it is empty");
  if (s[0] == '-') bad_size(text, "a size cannot be negative");
  std::size_t i = 0;
  std::string whole(take_digits(s, i));
  std::string fraction;
  if (i < s.size() && s[i] == '.') {
    ++i;
    fraction = take_digits(s, i);
    if (fraction.empty()) bad_size(text, "a decimal point must be followed by digits");
  }
  if (whole.empty() && fraction.empty()) bad_size(text, "it does not start with a number");

  // An exponent moves the decimal point: "1.5e3" is whole "1500", no fraction. ("EiB" is not an
  // exponent: an exponent is e/E followed by a digit or a sign.)
  if (i + 1 < s.size() && (s[i] == 'e' || s[i] == 'E') &&
      (is_digit(s[i + 1]) || s[i + 1] == '+' || s[i + 1] == '-')) {
    ++i;
    if (s[i] == '-') bad_size(text, "the exponent cannot be negative");
    if (s[i] == '+') ++i;
    std::string_view exp_digits = take_digits(s, i);
    if (exp_digits.empty()) bad_size(text, "an exponent must be followed by digits");
    exp_digits.remove_prefix(std::min(exp_digits.find_first_not_of('0'), exp_digits.size() - 1));
    const bool nonzero = (whole + fraction).find_first_not_of('0') != std::string::npos;
    if (exp_digits.size() > 3 || std::stoi(std::string(exp_digits)) > 40) {
      if (nonzero) bad_size(text, "it does not fit in 64 bits");
      whole = "0";
      fraction.clear();
    } else {
      const auto exp = static_cast<std::size_t>(std::stoi(std::string(exp_digits)));
      std::string digits = whole + fraction;
      const std::size_t point = whole.size() + exp;
      if (digits.size() < point) digits.append(point - digits.size(), '0');
      whole = digits.substr(0, point);
      fraction = digits.substr(point);
    }
  }

  const std::string_view unit = trim(s.substr(i));
  const std::uint64_t mult = unit_multiplier(unit);
  if (mult == 0) bad_size(text, "unknown unit \"" + std::string(unit) + "\"");

  // The whole part exactly, with overflow checks; the fraction in long double, rounded to the
  // nearest byte.
  std::uint64_t total = 0;
  for (char c : whole) {
    if (__builtin_mul_overflow(total, 10u, &total) ||
        __builtin_add_overflow(total, static_cast<unsigned>(c - '0'), &total)) {
      bad_size(text, "it does not fit in 64 bits");
    }
  }
  if (__builtin_mul_overflow(total, mult, &total)) bad_size(text, "it does not fit in 64 bits");
  if (!fraction.empty()) {
    if (mult == 1 && fraction.find_first_not_of('0') != std::string::npos) {
      bad_size(text, "a byte count must be a whole number");
    }
    // 40 digits decide the nearest byte of any unit (at most 2^60 bytes); more could only make
    // stold underflow.
    const long double part =
        std::stold("0." + fraction.substr(0, 40)) * static_cast<long double>(mult);
    const auto rounded = static_cast<std::uint64_t>(std::llroundl(part));
    if (__builtin_add_overflow(total, rounded, &total)) bad_size(text, "it does not fit in 64 bits");
  }
  return static_cast<std::size_t>(total);
}

}  // namespace spillway
