// config_string.cpp: parse_config. The contract is in config_string.hpp.
#include "config_string.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <vector>

#include "byte_size.hpp"
#include "spillway/errors.hpp"
#include "spillway/eviction/policy.hpp"

namespace spillway {
namespace {

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string quoted(std::string_view s) { return "\"" + std::string(s) + "\""; }

// A value that does not parse: the message names the key, the value and what was expected.
[[noreturn]] void bad_value(std::string_view key, std::string_view value, const std::string& expected) {
  throw invalid_argument("SPILLWAY_CONF: bad value " + quoted(value) + " for key " + quoted(key) +
                         ": " + expected);
}

std::size_t size_value(std::string_view key, std::string_view value) {
  try {
    return parse_bytes(value);
  } catch (const invalid_argument& e) {
    bad_value(key, value, e.what());
  }
}

bool bool_value(std::string_view key, std::string_view value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  bad_value(key, value, "expected True, False, true, false, 1 or 0");
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

struct key_rule {
  const char* expected;  // what a value looks like, for messages about empty values
  std::function<void(plugin_config&, std::string_view key, std::string_view value)> apply;
};

const std::map<std::string, key_rule, std::less<>>& key_rules() {
  static const std::map<std::string, key_rule, std::less<>> rules = {
      {"budget",
       {"a size such as 8GiB",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          const std::size_t bytes = size_value(k, v);
          if (bytes == 0) bad_value(k, v, "a budget of 0 bytes would refuse every allocation; expected at least 1 byte");
          c.allocator.budget = bytes;
        }}},
      {"budget_fraction",
       {"a number in (0, 1]",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          double f = 0;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), f);
          if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(f) || f <= 0 || f > 1)
            bad_value(k, v, "expected a number in (0, 1], e.g. 0.5");
          c.budget_fraction = f;
        }}},
      {"expandable_segments",
       {"True or False",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          c.allocator.expandable_segments = bool_value(k, v);
        }}},
      {"expandable_address_range",
       {"a size such as 64GiB (0: the device's memory)",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          c.allocator.expandable_address_range = size_value(k, v);
        }}},
      {"max_split_size_mb",
       {"a whole number of MiB over 20",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          std::size_t mib = 0;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), mib);
          if (ec != std::errc() || end != v.data() + v.size() || mib <= 20 || mib > (std::size_t{1} << 28))
            bad_value(k, v, "expected a whole number of MiB over 20 (the large pool's segment size), e.g. 128");
          c.allocator.max_split_size = mib << 20;
        }}},
      {"backend",
       {"cuda or sim",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          if (v != "cuda" && v != "sim") bad_value(k, v, "expected cuda or sim");
          c.backend = std::string(v);
        }}},
      {"sim_capacity",
       {"a size such as 16GiB",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          const std::size_t bytes = size_value(k, v);
          if (bytes == 0) bad_value(k, v, "expected at least 1 byte");
          c.sim_capacity = bytes;
        }}},
      {"policy",
       {"an eviction policy name",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          const std::vector<std::string> names = eviction::policy_names();
          for (const auto& n : names) {
            if (n == v) {
              c.policy = n;
              return;
            }
          }
          bad_value(k, v, "expected one of: " + join(names));
        }}},
      {"device",
       {"a device index such as 0",
        [](plugin_config& c, std::string_view k, std::string_view v) {
          int d = -1;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), d);
          if (ec != std::errc() || end != v.data() + v.size() || d < 0)
            bad_value(k, v, "expected a device index, an integer >= 0");
          c.device = d;
        }}},
  };
  return rules;
}

std::string known_keys() {
  std::string out;
  for (const auto& [name, rule] : key_rules()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

plugin_config parse_config(std::string_view text) {
  plugin_config config;
  if (trim(text).empty()) return config;
  std::map<std::string, std::string, std::less<>> seen;  // key -> value, for "given twice"
  std::size_t start = 0;
  for (int index = 1;; ++index) {
    const std::size_t comma = text.find(',', start);
    const std::string_view entry =
        trim(text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (entry.empty()) {
      throw invalid_argument("SPILLWAY_CONF: setting " + std::to_string(index) + " of " + quoted(text) +
                             " is empty (a comma at the start or end, or two in a row); expected "
                             "key:value settings separated by commas, e.g. budget:8GiB,backend:cuda");
    }
    const std::size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      throw invalid_argument("SPILLWAY_CONF: setting " + quoted(entry) +
                             " has no value: expected key:value, e.g. budget:8GiB");
    }
    const std::string_view key = trim(entry.substr(0, colon));
    const std::string_view value = trim(entry.substr(colon + 1));
    const auto rule = key_rules().find(key);
    if (rule == key_rules().end()) {
      throw invalid_argument("SPILLWAY_CONF: unknown key " + quoted(key) + " in " + quoted(entry) +
                             "; known keys (case-sensitive): " + known_keys());
    }
    if (const auto previous = seen.find(key); previous != seen.end()) {
      throw invalid_argument("SPILLWAY_CONF: key " + quoted(key) + " is given twice (" +
                             quoted(previous->second) + " and " + quoted(value) + "); give it once");
    }
    if (value.empty()) {
      throw invalid_argument("SPILLWAY_CONF: key " + quoted(key) + " has an empty value; expected " +
                             rule->second.expected);
    }
    rule->second.apply(config, key, value);
    seen.emplace(std::string(key), std::string(value));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (seen.count("budget") && seen.count("budget_fraction")) {
    throw invalid_argument("SPILLWAY_CONF: budget (" + quoted(seen.find("budget")->second) +
                           ") and budget_fraction (" + quoted(seen.find("budget_fraction")->second) +
                           ") exclude each other; give one of them");
  }
  return config;
}

std::size_t budget_for_device(const plugin_config& config, int device, std::size_t device_total) {
  if (config.device && *config.device != device) return unlimited_budget;
  if (config.budget_fraction) return fraction_of_memory(*config.budget_fraction, device_total);
  return config.allocator.budget;
}

std::size_t fraction_of_memory(double fraction, std::size_t device_total) noexcept {
  const long double bytes = static_cast<long double>(fraction) * static_cast<long double>(device_total);
  return std::max<std::size_t>(1, static_cast<std::size_t>(bytes));
}

}  // namespace spillway
