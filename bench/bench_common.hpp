// bench_common: what every spillway tool and benchmark shares.
//
// - parse_bytes("4GiB") (torch_plugin/byte_size.hpp, shared with SPILLWAY_CONF) / format via
//   spillway::format_bytes: sizes on command lines.
// - make_backend("sim" | "cuda" | "auto", ...): the device a tool runs on. "auto" picks CUDA when a
//   GPU is usable and the simulated device otherwise, and says which in backend_choice::why.
// - json_writer: a tiny streaming JSON writer for --json output (no dependency).
// - arg_parser: --name value / --flag parsing with clear errors naming the option and the value.
// - run_tool: every tool's main(): bad input exits 2 with the message, other failures exit 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "byte_size.hpp"
#include "spillway/device_backend.hpp"
#include "spillway/sim_device.hpp"

namespace spillway::bench {

// "123", "4KiB", "1.5GiB", "2MB" (decimal), "4k", "1e9" -> bytes. Throws spillway::invalid_argument
// naming the text and the accepted forms.
using spillway::parse_bytes;

struct backend_choice {
  std::shared_ptr<device_backend> backend;
  std::shared_ptr<sim_device> sim;  // set when the backend is the simulated device
  std::string kind;                 // "sim" or "cuda"
  std::string why;                  // e.g. "auto: no CUDA device (no CUDA driver)"
};

// kind: "sim", "cuda" or "auto". sim_capacity is used for the simulated device.
// Throws spillway::invalid_argument for an unknown kind, device_error when "cuda" is not usable.
backend_choice make_backend(const std::string& kind, int device_index, const sim_config& sim);

// Runs a tool's body. spillway::invalid_argument -> "<name>: <message>" and exit code 2 (bad
// input); any other exception -> "<name>: <message>" and exit code 1.
int run_tool(const char* name, int (*body)(int, char**), int argc, char** argv) noexcept;

class arg_parser {
 public:
  arg_parser(int argc, char** argv);
  bool flag(const std::string& name);  // --name present
  std::string get(const std::string& name, const std::string& fallback);
  std::size_t get_bytes(const std::string& name, std::size_t fallback);
  long long get_int(const std::string& name, long long fallback);
  double get_double(const std::string& name, double fallback);
  // Throws invalid_argument listing options that no get/flag call asked for (typos).
  void finish() const;

 private:
  std::map<std::string, std::optional<std::string>> args_;
  mutable std::vector<std::string> used_;
  std::vector<std::string> positional_;
};

class json_writer {
 public:
  explicit json_writer(std::ostream& out) : out_(out) {}
  json_writer& begin_object();
  json_writer& end_object();
  json_writer& begin_array();
  json_writer& end_array();
  json_writer& key(const std::string& k);
  json_writer& value(const std::string& v);
  json_writer& value(const char* v) { return value(std::string(v)); }
  json_writer& value(double v);
  json_writer& value(std::int64_t v);
  json_writer& value(std::uint64_t v);
  json_writer& value(int v) { return value(static_cast<std::int64_t>(v)); }
  json_writer& value(bool v);
  template <class T>
  json_writer& field(const std::string& k, const T& v) { return key(k).value(v); }

 private:
  void separator();
  std::ostream& out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

}  // namespace spillway::bench
