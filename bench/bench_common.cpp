// bench_common: sizes, backend choice, argument parsing and JSON output shared by the tools.
// The contract is in bench_common.hpp.
#include "bench_common.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "spillway/errors.hpp"

#if SPILLWAY_WITH_CUDA
#include "spillway/cuda_device.hpp"
#endif

namespace spillway::bench {

// --- make_backend ----------------------------------------------------------------------------

namespace {

backend_choice make_sim(int device_index, const sim_config& sim, std::string why) {
  sim_config config = sim;
  config.device_index = device_index;
  backend_choice choice;
  choice.sim = std::make_shared<sim_device>(config);
  choice.backend = choice.sim;
  choice.kind = "sim";
  choice.why = std::move(why);
  return choice;
}

}  // namespace

backend_choice make_backend(const std::string& kind, int device_index, const sim_config& sim) {
  if (kind == "sim") return make_sim(device_index, sim, "sim: requested");
  if (kind == "cuda") {
#if SPILLWAY_WITH_CUDA
    backend_choice choice;
    choice.backend = make_cuda_device(device_index);
    choice.kind = "cuda";
    choice.why = "cuda: requested";
    return choice;
#else
    throw spillway::device_error(
        "device \"cuda\" is not available: spillway was built without CUDA "
        "(configure with -DSPILLWAY_WITH_CUDA=ON where the CUDA toolkit is installed)");
#endif
  }
  if (kind == "auto") {
#if SPILLWAY_WITH_CUDA
    const int count = cuda_device_count();
    if (count > 0) {
      backend_choice choice;
      choice.backend = make_cuda_device(device_index);
      choice.kind = "cuda";
      choice.why = "auto: " + std::to_string(count) + " CUDA device(s) found";
      return choice;
    }
    return make_sim(device_index, sim, "auto: no CUDA device (" + cuda_unavailable_reason() + ")");
#else
    return make_sim(device_index, sim, "auto: built without CUDA");
#endif
  }
  throw spillway::invalid_argument("unknown device \"" + kind + "\": expected sim, cuda or auto");
}

// --- arg_parser ------------------------------------------------------------------------------

namespace {

// "--name", "--name=value" and "-n" are options; "-5" and "-" are values.
bool is_option(const std::string& a) {
  if (a.size() >= 3 && a[0] == '-' && a[1] == '-') return true;
  return a.size() >= 2 && a[0] == '-' && a[1] != '-' && !(a[1] >= '0' && a[1] <= '9') && a[1] != '.';
}

std::string strip_dashes(const std::string& a) { return a.substr(a[1] == '-' ? 2 : 1); }

std::string spelled(const std::string& name) { return (name.size() == 1 ? "-" : "--") + name; }

}  // namespace

arg_parser::arg_parser(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (!is_option(a)) {
      positional_.push_back(a);
      continue;
    }
    std::string name = strip_dashes(a);
    std::optional<std::string> value;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc && !is_option(argv[i + 1])) {
      value = argv[++i];
    }
    if (args_.count(name)) throw spillway::invalid_argument("option " + spelled(name) + " is given twice");
    args_[name] = std::move(value);
  }
}

bool arg_parser::flag(const std::string& name) {
  used_.push_back(name);
  const auto it = args_.find(name);
  if (it == args_.end()) return false;
  if (it->second) {
    throw spillway::invalid_argument("option " + spelled(name) + " takes no value, but got \"" +
                                     *it->second + "\"");
  }
  return true;
}

std::string arg_parser::get(const std::string& name, const std::string& fallback) {
  used_.push_back(name);
  const auto it = args_.find(name);
  if (it == args_.end()) return fallback;
  if (!it->second) throw spillway::invalid_argument("option " + spelled(name) + " needs a value");
  return *it->second;
}

std::size_t arg_parser::get_bytes(const std::string& name, std::size_t fallback) {
  if (!args_.count(name)) {
    used_.push_back(name);
    return fallback;
  }
  const std::string v = get(name, "");
  try {
    return parse_bytes(v);
  } catch (const spillway::invalid_argument& e) {
    throw spillway::invalid_argument("option " + spelled(name) + ": " + e.what());
  }
}

long long arg_parser::get_int(const std::string& name, long long fallback) {
  if (!args_.count(name)) {
    used_.push_back(name);
    return fallback;
  }
  const std::string v = get(name, "");
  long long out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size()) {
    throw spillway::invalid_argument("option " + spelled(name) + ": \"" + v +
                                     "\" is not an integer");
  }
  return out;
}

double arg_parser::get_double(const std::string& name, double fallback) {
  if (!args_.count(name)) {
    used_.push_back(name);
    return fallback;
  }
  const std::string v = get(name, "");
  double out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(out)) {
    throw spillway::invalid_argument("option " + spelled(name) + ": \"" + v +
                                     "\" is not a number");
  }
  return out;
}

void arg_parser::finish() const {
  std::string unknown;
  for (const auto& [name, value] : args_) {
    bool asked = false;
    for (const auto& u : used_) asked = asked || u == name;
    if (!asked) unknown += (unknown.empty() ? "" : ", ") + spelled(name);
  }
  if (!unknown.empty()) {
    std::string known;
    for (const auto& u : used_) {
      const std::string s = spelled(u);
      if (known.find(s + ",") == std::string::npos) known += s + ", ";
    }
    if (!known.empty()) known.resize(known.size() - 2);
    throw spillway::invalid_argument("unknown option(s) " + unknown + " (this tool takes: " + known + ")");
  }
  if (!positional_.empty()) {
    throw spillway::invalid_argument("unexpected argument \"" + positional_.front() +
                                     "\": every argument is an --option (or --option value)");
  }
}

// --- json_writer -----------------------------------------------------------------------------
// Pretty-printed, two spaces per level: the results files are read by people too.

void json_writer::separator() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (first_.empty()) return;
  out_ << (first_.back() ? "\n" : ",\n") << std::string(2 * first_.size(), ' ');
  first_.back() = false;
}

json_writer& json_writer::begin_object() {
  separator();
  out_ << '{';
  first_.push_back(true);
  return *this;
}

json_writer& json_writer::end_object() {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) out_ << '\n' << std::string(2 * first_.size(), ' ');
  out_ << '}';
  if (first_.empty()) out_ << '\n';
  return *this;
}

json_writer& json_writer::begin_array() {
  separator();
  out_ << '[';
  first_.push_back(true);
  return *this;
}

json_writer& json_writer::end_array() {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) out_ << '\n' << std::string(2 * first_.size(), ' ');
  out_ << ']';
  if (first_.empty()) out_ << '\n';
  return *this;
}

namespace {

void write_string(std::ostream& out, const std::string& s) {
  out << '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\b': out << "\\b"; break;
      case '\f': out << "\\f"; break;
      case '\n': out << "\\n"; break;
      case '\r': out << "\\r"; break;
      case '\t': out << "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out << buf;
        } else {
          out << ch;  // UTF-8 passes through unchanged
        }
    }
  }
  out << '"';
}

}  // namespace

json_writer& json_writer::key(const std::string& k) {
  separator();
  write_string(out_, k);
  out_ << ": ";
  after_key_ = true;
  return *this;
}

json_writer& json_writer::value(const std::string& v) {
  separator();
  write_string(out_, v);
  return *this;
}

json_writer& json_writer::value(double v) {
  separator();
  if (!std::isfinite(v)) {
    out_ << "null";  // JSON has no NaN or infinity
    return *this;
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  out_.write(buf, end - buf);
  return *this;
}

json_writer& json_writer::value(std::int64_t v) {
  separator();
  out_ << v;
  return *this;
}

json_writer& json_writer::value(std::uint64_t v) {
  separator();
  out_ << v;
  return *this;
}

json_writer& json_writer::value(bool v) {
  separator();
  out_ << (v ? "true" : "false");
  return *this;
}

int run_tool(const char* name, int (*body)(int, char**), int argc, char** argv) noexcept {
  try {
    return body(argc, argv);
  } catch (const spillway::invalid_argument& e) {
    std::fprintf(stderr, "%s: %s\n(run with --help for the options)\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace spillway::bench
