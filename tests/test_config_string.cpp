// test_config_string: SPILLWAY_CONF parsing (torch_plugin/config_string.hpp) and the size parser
// it shares with the tools (torch_plugin/byte_size.hpp).
//
// It proves: every key reads every documented form of its value; blanks are ignored and keys are
// case-sensitive; an empty text gives the defaults; every bad input -- unknown key (listing the
// known ones), missing colon, empty setting, empty value, duplicate key, bad size, bool, number,
// backend, policy or device, budget with budget_fraction -- is invalid_argument naming the key,
// the value and what was expected; budget_for_device applies budget, budget_fraction and device;
// parse_bytes reads exponents ("1e9") exactly and refuses negative or oversized ones.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "byte_size.hpp"
#include "config_string.hpp"
#include "spillway/errors.hpp"

using namespace spillway;

namespace {

constexpr std::size_t K = 1024, M = K * K, G = M * K;

std::string error_of(const std::string& text) {
  try {
    parse_config(text);
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("the empty text gives the defaults") {
  for (const char* text : {"", "   ", "\t\n"}) {
    CAPTURE(text);
    const plugin_config c = parse_config(text);
    CHECK(c.allocator.budget == unlimited_budget);
    CHECK(!c.allocator.expandable_segments);
    CHECK(c.allocator.expandable_address_range == 0);
    CHECK(c.backend == "cuda");
    CHECK(!c.budget_fraction);
    CHECK(c.policy.empty());
    CHECK(!c.device);
    CHECK(c.sim_capacity == 16 * G);
  }
}

TEST_CASE("the example from the issue reads as written") {
  const plugin_config c =
      parse_config("budget:8GiB,expandable_segments:True,backend:cuda,policy:dtr-frag,device:0");
  CHECK(c.allocator.budget == 8 * G);
  CHECK(c.allocator.expandable_segments);
  CHECK(c.backend == "cuda");
  CHECK(c.policy == "dtr-frag");
  CHECK(c.device == 0);
  const plugin_config f = parse_config("budget_fraction:0.5,backend:sim");
  CHECK(f.budget_fraction == 0.5);
  CHECK(f.backend == "sim");
}

TEST_CASE("every key reads every documented form") {
  SUBCASE("budget: sizes in every unit, and exponents") {
    CHECK(parse_config("budget:4GiB").allocator.budget == 4 * G);
    CHECK(parse_config("budget:512MiB").allocator.budget == 512 * M);
    CHECK(parse_config("budget:1e9").allocator.budget == 1'000'000'000);
    CHECK(parse_config("budget:2.5GB").allocator.budget == 2'500'000'000);
    CHECK(parse_config("budget:1.5g").allocator.budget == 3 * G / 2);
    CHECK(parse_config("budget:4096").allocator.budget == 4096);
    CHECK(parse_config("budget:1").allocator.budget == 1);
  }
  SUBCASE("budget_fraction: numbers in (0, 1]") {
    CHECK(parse_config("budget_fraction:1").budget_fraction == 1.0);
    CHECK(parse_config("budget_fraction:0.25").budget_fraction == 0.25);
    CHECK(parse_config("budget_fraction:1e-3").budget_fraction == 1e-3);
    CHECK(parse_config("budget_fraction:.5").budget_fraction == 0.5);
  }
  SUBCASE("expandable_segments: the six booleans") {
    for (const char* yes : {"True", "true", "1"}) {
      CAPTURE(yes);
      CHECK(parse_config(std::string("expandable_segments:") + yes).allocator.expandable_segments);
    }
    for (const char* no : {"False", "false", "0"}) {
      CAPTURE(no);
      CHECK(!parse_config(std::string("expandable_segments:") + no).allocator.expandable_segments);
    }
  }
  SUBCASE("expandable_address_range, sim_capacity: sizes") {
    CHECK(parse_config("expandable_address_range:64GiB").allocator.expandable_address_range == 64 * G);
    CHECK(parse_config("expandable_address_range:0").allocator.expandable_address_range == 0);
    CHECK(parse_config("sim_capacity:2GiB").sim_capacity == 2 * G);
  }
  SUBCASE("backend: cuda and sim") {
    CHECK(parse_config("backend:cuda").backend == "cuda");
    CHECK(parse_config("backend:sim").backend == "sim");
  }
  SUBCASE("policy: every eviction policy") {
    for (const char* p : {"dtr", "dtr-frag", "lru", "largest"}) {
      CAPTURE(p);
      CHECK(parse_config(std::string("policy:") + p).policy == p);
    }
  }
  SUBCASE("device: non-negative integers") {
    CHECK(parse_config("device:0").device == 0);
    CHECK(parse_config("device:7").device == 7);
  }
}

TEST_CASE("blanks around keys, values and commas are ignored; keys are case-sensitive") {
  const plugin_config c = parse_config("  budget : 8 GiB ,\tbackend:sim , expandable_segments: True ");
  CHECK(c.allocator.budget == 8 * G);
  CHECK(c.backend == "sim");
  CHECK(c.allocator.expandable_segments);
  CHECK(contains(error_of("Budget:8GiB"), "unknown key \"Budget\""));
  CHECK(contains(error_of("BACKEND:sim"), "unknown key \"BACKEND\""));
  CHECK(contains(error_of("backend:SIM"), "expected cuda or sim"));  // values too
}

TEST_CASE("an unknown key names itself and lists the known keys") {
  const std::string e = error_of("budget:8GiB,bugdet:4GiB");
  CHECK(contains(e, "SPILLWAY_CONF: unknown key \"bugdet\" in \"bugdet:4GiB\""));
  CHECK(contains(e, "known keys (case-sensitive): backend, budget, budget_fraction, device, "
                    "expandable_address_range, expandable_segments, max_split_size_mb, policy, "
                    "sim_capacity"));
  CHECK(contains(error_of("garbage_collection_threshold:0.6"),
                 "unknown key \"garbage_collection_threshold\""));
}

TEST_CASE("max_split_size_mb takes PyTorch's whole MiB over 20") {
  CHECK(parse_config("max_split_size_mb:128").allocator.max_split_size == std::size_t{128} << 20);
  CHECK(parse_config("").allocator.max_split_size == no_split_limit);
  for (const char* bad : {"max_split_size_mb:20", "max_split_size_mb:0", "max_split_size_mb:-5",
                          "max_split_size_mb:1.5", "max_split_size_mb:128MiB"}) {
    CAPTURE(bad);
    const std::string e = error_of(bad);
    CHECK(contains(e, "max_split_size_mb"));
    CHECK(contains(e, "expected a whole number of MiB over 20"));
  }
}

TEST_CASE("malformed settings say what the format is") {
  CHECK(contains(error_of("budget"), "setting \"budget\" has no value: expected key:value"));
  CHECK(contains(error_of("budget=8GiB"), "setting \"budget=8GiB\" has no value"));
  CHECK(contains(error_of("budget:8GiB,"), "setting 2 of \"budget:8GiB,\" is empty"));
  CHECK(contains(error_of(",budget:8GiB"), "setting 1 of \",budget:8GiB\" is empty"));
  CHECK(contains(error_of("budget:8GiB,,backend:sim"), "setting 2 of"));
  CHECK(contains(error_of("budget:8GiB, ,backend:sim"), "is empty"));
  CHECK(contains(error_of(":8GiB"), "unknown key \"\""));
}

TEST_CASE("an empty value names the key and what a value looks like") {
  CHECK(contains(error_of("budget:"), "key \"budget\" has an empty value; expected a size such as 8GiB"));
  CHECK(contains(error_of("backend: "), "key \"backend\" has an empty value; expected cuda or sim"));
  CHECK(contains(error_of("expandable_segments:"), "expected True or False"));
  CHECK(contains(error_of("device:"), "expected a device index such as 0"));
}

TEST_CASE("a key given twice names both values") {
  CHECK(contains(error_of("budget:8GiB,backend:sim,budget:4GiB"),
                 "key \"budget\" is given twice (\"8GiB\" and \"4GiB\")"));
  CHECK(contains(error_of("backend:sim,backend:sim"), "key \"backend\" is given twice"));
}

TEST_CASE("bad values name the key, the value and what was expected") {
  struct bad {
    const char* text;
    const char* expected;
  };
  const std::vector<bad> cases = {
      {"budget:8XB", "bad value \"8XB\" for key \"budget\": invalid size \"8XB\": unknown unit \"XB\""},
      {"budget:-1GiB", "bad value \"-1GiB\" for key \"budget\": invalid size \"-1GiB\": a size cannot be negative"},
      {"budget:1.5", "for key \"budget\": invalid size \"1.5\": a byte count must be a whole number"},
      {"budget:0", "bad value \"0\" for key \"budget\": a budget of 0 bytes would refuse every allocation"},
      {"budget:eight", "for key \"budget\": invalid size \"eight\": it does not start with a number"},
      {"budget:8:GiB", "bad value \"8:GiB\" for key \"budget\""},
      {"budget:1e30", "it does not fit in 64 bits"},
      {"budget_fraction:0", "bad value \"0\" for key \"budget_fraction\": expected a number in (0, 1]"},
      {"budget_fraction:1.5", "bad value \"1.5\" for key \"budget_fraction\": expected a number in (0, 1]"},
      {"budget_fraction:-0.5", "expected a number in (0, 1]"},
      {"budget_fraction:half", "bad value \"half\" for key \"budget_fraction\""},
      {"budget_fraction:0.5x", "bad value \"0.5x\""},
      {"budget_fraction:nan", "expected a number in (0, 1]"},
      {"budget_fraction:inf", "expected a number in (0, 1]"},
      {"expandable_segments:yes", "bad value \"yes\" for key \"expandable_segments\": expected True, False, true, false, 1 or 0"},
      {"expandable_segments:TRUE", "expected True, False, true, false, 1 or 0"},
      {"expandable_segments:2", "expected True, False"},
      {"expandable_address_range:lots", "for key \"expandable_address_range\": invalid size"},
      {"backend:rocm", "bad value \"rocm\" for key \"backend\": expected cuda or sim"},
      {"backend:auto", "expected cuda or sim"},
      {"sim_capacity:0", "bad value \"0\" for key \"sim_capacity\": expected at least 1 byte"},
      {"policy:fifo", "bad value \"fifo\" for key \"policy\": expected one of: "},
      {"policy:DTR", "bad value \"DTR\" for key \"policy\""},
      {"device:-1", "bad value \"-1\" for key \"device\": expected a device index, an integer >= 0"},
      {"device:gpu0", "bad value \"gpu0\" for key \"device\""},
      {"device:1.0", "bad value \"1.0\" for key \"device\""},
      {"device:99999999999", "bad value \"99999999999\" for key \"device\""},
  };
  for (const bad& b : cases) {
    CAPTURE(b.text);
    const std::string e = error_of(b.text);
    CHECK(contains(e, "SPILLWAY_CONF: "));
    CHECK(contains(e, b.expected));
  }
  // The policy list is the eviction library's.
  const std::string e = error_of("policy:fifo");
  for (const char* p : {"dtr", "dtr-frag", "lru", "largest"}) CHECK(contains(e, p));
}

TEST_CASE("budget and budget_fraction exclude each other") {
  CHECK(contains(error_of("budget:8GiB,budget_fraction:0.5"),
                 "budget (\"8GiB\") and budget_fraction (\"0.5\") exclude each other; give one of them"));
}

TEST_CASE("budget_for_device applies budget, budget_fraction and device") {
  const std::size_t total = 80 * G;
  CHECK(budget_for_device(parse_config(""), 0, total) == unlimited_budget);
  CHECK(budget_for_device(parse_config("budget:8GiB"), 0, total) == 8 * G);
  CHECK(budget_for_device(parse_config("budget:8GiB"), 3, total) == 8 * G);  // every device
  CHECK(budget_for_device(parse_config("budget_fraction:0.5"), 0, total) == 40 * G);
  CHECK(budget_for_device(parse_config("budget_fraction:0.5"), 1, 2 * G) == G);  // its own memory
  CHECK(budget_for_device(parse_config("budget_fraction:1e-12"), 0, 1000) == 1);  // never 0
  const plugin_config only1 = parse_config("budget:8GiB,device:1");
  CHECK(budget_for_device(only1, 1, total) == 8 * G);
  CHECK(budget_for_device(only1, 0, total) == unlimited_budget);
  CHECK(budget_for_device(only1, 2, total) == unlimited_budget);
  CHECK(budget_for_device(parse_config("budget_fraction:0.25,device:0"), 0, total) == 20 * G);
}

TEST_CASE("parse_bytes reads exponents exactly") {
  CHECK(parse_bytes("1e9") == 1'000'000'000);
  CHECK(parse_bytes("1E9") == 1'000'000'000);
  CHECK(parse_bytes("1e+3") == 1000);
  CHECK(parse_bytes("2.5e3") == 2500);
  CHECK(parse_bytes("1.25e2") == 125);
  CHECK(parse_bytes("1e0") == 1);
  CHECK(parse_bytes("0e99") == 0);
  CHECK(parse_bytes("1e3KiB") == 1000 * K);
  CHECK(parse_bytes("1.5e1 MiB") == 15 * M);
  CHECK(parse_bytes("1e19") == 10'000'000'000'000'000'000ull);
  CHECK(parse_bytes(" 4 GiB ") == 4 * G);
  CHECK(parse_bytes("1e0005") == 100'000);  // leading zeros of an exponent count for nothing
  CHECK(parse_bytes("1e000") == 1);
  // A fraction too long for long double: its first digits decide.
  CHECK(parse_bytes("0." + std::string(5000, '0') + "1GiB") == 0);
  CHECK(parse_bytes("1." + std::string(5000, '0') + "1KiB") == K);
  CHECK(parse_bytes("0.5" + std::string(5000, '9') + "KiB") == 614);  // 0.6 KiB, to the byte
}

TEST_CASE("parse_bytes refuses bad exponents with the reason") {
  auto error = [](const char* text) {
    try {
      parse_bytes(text);
    } catch (const spillway::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(contains(error("1e-3"), "the exponent cannot be negative"));
  CHECK(contains(error("1e+"), "an exponent must be followed by digits"));
  CHECK(contains(error("1e20"), "does not fit in 64 bits"));
  CHECK(contains(error("1e400"), "does not fit in 64 bits"));
  CHECK(contains(error("1.5e0"), "a byte count must be a whole number"));
  CHECK(contains(error(("1." + std::string(5000, '0') + "1").c_str()), "a byte count must be a whole number"));
  CHECK(contains(error("1e"), "unknown unit \"e\""));
  CHECK(contains(error("16EiB"), "unknown unit \"EiB\""));  // EiB is a unit, not an exponent
  CHECK(contains(error("x"), "e.g. 512MiB, 1.5GiB, 4k, 1e9"));
}
