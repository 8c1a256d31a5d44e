// byte_size: sizes written by people ("8GiB", "512MiB", "1e9") -> bytes.
//
// Contract
// - parse_bytes accepts a non-negative number with an optional decimal fraction, an optional
//   exponent (e/E followed by digits) and an optional unit, with blanks allowed around the number
//   and the unit:
//     B                        bytes (also: no unit)
//     KiB, MiB, GiB, TiB       binary multiples (1024^n)
//     KB/kB, MB, GB, TB        decimal multiples (1000^n)
//     k, m, g, t (any case)    binary shorthand
//   "1e9" is 1,000,000,000 bytes; "1.5GiB" is 1,610,612,736. The value must be a whole number of
//   bytes when there is no unit ("1.5" is refused) and is rounded to the nearest byte otherwise.
// - Anything else, and any value above 2^64 - 1, throws spillway::invalid_argument whose message
//   names the text, says what is wrong with it and lists the accepted forms.
//
// Shared by every edge that reads sizes: SPILLWAY_CONF (config_string.hpp) and the command-line
// tools (bench/bench_common.hpp).
#pragma once

#include <cstddef>
#include <string_view>

namespace spillway {

std::size_t parse_bytes(std::string_view text);

}  // namespace spillway
