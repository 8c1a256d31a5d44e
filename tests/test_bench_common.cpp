// test_bench_common: what every tool shares (bench/bench_common.hpp).
//
// It proves: parse_bytes reads plain, binary (KiB..TiB), decimal (KB..TB), shorthand (k, m, g, t)
// and fractional sizes exactly, and refuses the rest with a message naming the text and the
// accepted forms; arg_parser reads --name value, --name=value, -o value and flags, and refuses
// flags with values, missing values, non-numbers, repeated and unknown options and stray
// arguments; json_writer escapes strings and places commas correctly; make_backend builds the
// simulated device for "sim" and "auto" (without CUDA) and refuses unknown kinds.
#include <doctest/doctest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::bench;

namespace {

std::string error_of_bytes(const std::string& text) {
  try {
    parse_bytes(text);
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// An arg_parser over the words of `line` (the program name is added).
struct args {
  std::vector<std::string> words;
  std::vector<char*> argv;
  explicit args(std::vector<std::string> w) : words(std::move(w)) {
    words.insert(words.begin(), "tool");
    for (auto& s : words) argv.push_back(s.data());
  }
  arg_parser parser() { return arg_parser(static_cast<int>(argv.size()), argv.data()); }
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("parse_bytes reads every documented form exactly") {
  const std::size_t K = 1024, M = K * K, G = M * K, T = G * K;
  CHECK(parse_bytes("0") == 0);
  CHECK(parse_bytes("123") == 123);
  CHECK(parse_bytes("123B") == 123);
  CHECK(parse_bytes("4KiB") == 4 * K);
  CHECK(parse_bytes("512MiB") == 512 * M);
  CHECK(parse_bytes("1.5GiB") == 3 * G / 2);
  CHECK(parse_bytes("2TiB") == 2 * T);
  CHECK(parse_bytes("2KB") == 2000);
  CHECK(parse_bytes("2kB") == 2000);
  CHECK(parse_bytes("3MB") == 3'000'000);
  CHECK(parse_bytes("1.25GB") == 1'250'000'000);
  CHECK(parse_bytes("1TB") == 1'000'000'000'000);
  CHECK(parse_bytes("4k") == 4 * K);
  CHECK(parse_bytes("4K") == 4 * K);
  CHECK(parse_bytes("16m") == 16 * M);
  CHECK(parse_bytes("2g") == 2 * G);
  CHECK(parse_bytes("1t") == T);
  CHECK(parse_bytes(" 8 GiB ") == 8 * G);
  CHECK(parse_bytes(".5k") == 512);
  CHECK(parse_bytes("0.1KiB") == 102);  // rounded to the nearest byte
  CHECK(parse_bytes("18446744073709551615") == ~std::size_t{0});
}

TEST_CASE("parse_bytes refuses the rest, naming the text and the accepted forms") {
  for (const char* bad : {"", "GiB", "-1", "-1GiB", "4XB", "4 gib", "1.5", "1.", "1..5k", "abc", "16EiB",
                          "18446744073709551616", "17179869184GiB"}) {
    CAPTURE(bad);
    const std::string message = error_of_bytes(bad);
    CHECK(contains(message, std::string("invalid size \"") + bad + "\""));
    CHECK(contains(message, "KiB, MiB, GiB, TiB"));
  }
  CHECK(contains(error_of_bytes("-1"), "cannot be negative"));
  CHECK(contains(error_of_bytes("4XB"), "unknown unit \"XB\""));
  CHECK(contains(error_of_bytes("1.5"), "whole number"));
  CHECK(contains(error_of_bytes("17179869184GiB"), "64 bits"));
}

TEST_CASE("arg_parser reads options and values") {
  args a({"--device", "sim", "--json", "--budget=2GiB", "-o", "x.trace", "--seed", "-5", "--ratio", "0.5"});
  arg_parser p = a.parser();
  CHECK(p.get("device", "auto") == "sim");
  CHECK(p.flag("json"));
  CHECK(!p.flag("smoke"));
  CHECK(p.get_bytes("budget", 0) == std::size_t{2} << 30);
  CHECK(p.get("o", "") == "x.trace");
  CHECK(p.get_int("seed", 1) == -5);
  CHECK(p.get_double("ratio", 1.0) == 0.5);
  CHECK(p.get_int("missing", 42) == 42);
  CHECK(p.get_bytes("capacity", 7) == 7);
  CHECK_NOTHROW(p.finish());
}

TEST_CASE("arg_parser refuses misuse with messages naming the option") {
  {
    args a({"--json", "yes"});
    arg_parser p = a.parser();
    CHECK(contains(error_of([&] { p.flag("json"); }), "--json takes no value, but got \"yes\""));
  }
  {
    args a({"--device"});
    arg_parser p = a.parser();
    CHECK(contains(error_of([&] { p.get("device", "auto"); }), "--device needs a value"));
  }
  {
    args a({"--threads", "many", "--budget", "lots", "--ratio", "1/2"});
    arg_parser p = a.parser();
    CHECK(contains(error_of([&] { p.get_int("threads", 1); }), "--threads: \"many\" is not an integer"));
    CHECK(contains(error_of([&] { p.get_bytes("budget", 1); }), "--budget: invalid size \"lots\""));
    CHECK(contains(error_of([&] { p.get_double("ratio", 1); }), "--ratio: \"1/2\" is not a number"));
  }
  {
    args a({"--seed", "1", "--seed", "2"});
    CHECK(contains(error_of([&] { a.parser(); }), "--seed is given twice"));
  }
  {
    args a({"--jsno", "--device", "sim"});
    arg_parser p = a.parser();
    p.flag("json");
    p.get("device", "auto");
    const std::string message = error_of([&] { p.finish(); });
    CHECK(contains(message, "unknown option(s) --jsno"));
    CHECK(contains(message, "--json"));
    CHECK(contains(message, "--device"));
  }
  {
    args a({"trace.gz"});
    arg_parser p = a.parser();
    CHECK(contains(error_of([&] { p.finish(); }), "unexpected argument \"trace.gz\""));
  }
}

TEST_CASE("json_writer escapes strings and separates elements") {
  std::ostringstream out;
  json_writer j(out);
  j.begin_object();
  j.field("s", "quote \" backslash \\ newline \n tab \t bell \x07 utf8 \xc3\xa9");
  j.key("empty_array").begin_array().end_array();
  j.key("empty_object").begin_object().end_object();
  j.key("list").begin_array().value(1).value(std::int64_t{-2}).value(std::uint64_t{3}).value(true).value(0.5).end_array();
  j.field("nan", std::nan(""));
  j.key("nested").begin_array().begin_object().field("a", 1).end_object().begin_object().end_object().end_array();
  j.end_object();
  const std::string expected =
      "{\n"
      "  \"s\": \"quote \\\" backslash \\\\ newline \\n tab \\t bell \\u0007 utf8 \xc3\xa9\",\n"
      "  \"empty_array\": [],\n"
      "  \"empty_object\": {},\n"
      "  \"list\": [\n"
      "    1,\n"
      "    -2,\n"
      "    3,\n"
      "    true,\n"
      "    0.5\n"
      "  ],\n"
      "  \"nan\": null,\n"
      "  \"nested\": [\n"
      "    {\n"
      "      \"a\": 1\n"
      "    },\n"
      "    {}\n"
      "  ]\n"
      "}\n";
  CHECK(out.str() == expected);
}

TEST_CASE("make_backend builds the simulated device and refuses unknown kinds") {
  sim_config sim;
  sim.capacity = std::size_t{1} << 30;
  const backend_choice s = make_backend("sim", 0, sim);
  REQUIRE(s.sim);
  CHECK(s.backend == s.sim);
  CHECK(s.kind == "sim");
  CHECK(s.backend->total_memory() == std::size_t{1} << 30);
  CHECK(contains(error_of([&] { make_backend("tpu", 0, sim); }), "unknown device \"tpu\": expected sim, cuda or auto"));
  const backend_choice a = make_backend("auto", 0, sim);
  CHECK(contains(a.why, "auto: "));
#if !SPILLWAY_WITH_CUDA
  CHECK(a.kind == "sim");
  CHECK(a.why == "auto: built without CUDA");
  CHECK_THROWS_AS(make_backend("cuda", 0, sim), spillway::device_error);
#endif
}
