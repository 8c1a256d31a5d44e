// test_op_trace: the operator trace format (bench/op_trace.hpp, docs/op_trace_format.md), the step
// builder and the synthetic models.
//
// It proves: every synthetic model survives the text form unchanged (plain and gzip) and is
// deterministic; comments, blank lines, tabs, CRLF and `b` lines between ops are accepted; every
// kind of bad input is refused with spillway::invalid_argument naming the file, the line number and
// the offending value; the writer refuses what the reader would; liveness follows `f` lines, last
// uses and parameters; and the derived backward reads what each forward op saved and sums the
// gradients of a buffer used twice.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include "op_trace.hpp"
#include "op_trace_builder.hpp"
#include "op_trace_synth.hpp"
#include "spillway/errors.hpp"

using namespace spillway;
using namespace spillway::op_trace;

namespace {

const char* const k_header = "# spillway-op-trace v1 model=tiny source=hand\n";

trace_data tiny() {
  return parse_op_trace(std::string(k_header) +
                            "b 10 4096 param\n"
                            "b 11 1024\n"
                            "b 12 1024\n"
                            "b 13 8\n"
                            "o a 100 in 10 out 11\n"
                            "o b 200 in 11 10 out 12\n"
                            "f 11\n"
                            "phase backward\n"
                            "o c 300 in 12 out 13\n",
                        "tiny.optrace");
}

std::string error_of(const std::string& body) {
  try {
    (void)parse_op_trace(std::string(k_header) + body, "bad.optrace");
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("every synthetic model survives the text form, plain and gzip") {
  for (const std::string& m : synth_models()) {
    synth_options o;
    o.model = m;
    o.layers = 2;
    o.batch = 2;
    const trace_data t = synthesize(o);
    CAPTURE(m);
    CHECK(parse_op_trace(to_text(t), m) == t);
    CHECK(to_text(t) == to_text(synthesize(o)));  // deterministic
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("spillway-op-trace-" + std::to_string(::getpid()) + "-" + m + ".optrace.gz")).string();
    write_op_trace(t, path);
    CHECK(read_op_trace(path) == t);
    std::remove(path.c_str());
  }
}

TEST_CASE("the reader accepts comments, blank lines, tabs, CRLF and late b lines") {
  const trace_data t = parse_op_trace(std::string(k_header) +
                                          "# a comment\r\n"
                                          "\n"
                                          "b\t1\t64\tparam\r\n"
                                          "b 2 64\n"
                                          "o x 5 in 1 out 2\n"
                                          "b 3 64\n"
                                          "o y 5 in 2 out 3\n",
                                      "t");
  REQUIRE(t.ops.size() == 2);
  CHECK(t.buffers.size() == 3);
  CHECK(t.ops[1].inputs == std::vector<std::uint32_t>{1});
  CHECK(t.model == "tiny");
  CHECK(t.source == "hand");
}

TEST_CASE("bad input names the file, the line and the value") {
  const struct {
    const char* body;
    const char* says;
  } cases[] = {
      {"z 1\n", "bad.optrace:2: unknown line \"z\""},
      {"b 1\n", "expected \"b <id> <bytes> [param]\""},
      {"b 1 0\n", "buffer 1 has 0 bytes"},
      {"b 1 -5\n", "size \"-5\" is negative"},
      {"b 1 12x\n", "size \"12x\" is not a number"},
      {"b 1 99999999999999999999999\n", "out of range"},
      {"b 1 4 param\nb 1 8\n", "bad.optrace:3: buffer 1 is declared twice"},
      {"b 1 4 extra\n", "expected \"b <id> <bytes> [param]\""},
      {"o x 5 in 7 out\n", "buffer 7 is not declared"},
      {"b 1 4\nb 2 4\no x 5 in 1 out 2\n", "buffer 1 is read before any op writes it"},
      {"b 1 4\no x 5 in out 1\no y 5 in out 1\n", "bad.optrace:4: buffer 1 is written a second time"},
      {"b 1 4 param\no x 5 in 1 out 1\n", "buffer 1 is both read and written"},
      {"b 1 4\no x 5 in out 1\nf 1\no y 5 in 1 out\n", "buffer 1 is read after its free"},
      {"b 1 4\nf 1\n", "a free before the first op"},
      {"b 1 4 param\nb 2 4\no x 5 in 1 out 2\nf 1\nf 1\n", "buffer 1 is freed twice"},
      {"b 1 4 param\nb 2 4\no x 5 in 1 out 2\no y 5 in 2 out 1\n", "parameter 1 is written by this op but was read before"},
      {"b 1 4 param\no x 5 in 1 1 out\n", "buffer 1 is listed twice as an input"},
      {"b 1 4\no x 5 out 1\n", "expected \"o <name> <duration_ns> in <ids...> out <ids...>\""},
      {"b 1 4\no x five in out 1\n", "duration \"five\" is not a number"},
      {"phase\n", "expected \"phase <name>\""},
  };
  for (const auto& c : cases) {
    CAPTURE(c.body);
    const std::string message = error_of(c.body);
    CHECK_MESSAGE(message.find(c.says) != std::string::npos, message);
  }
  CHECK(error_of("").find("(accepted)") != std::string::npos);
  for (const char* header : {"", "# spillway-trace v1\n", "# spillway-op-trace v2\n", "# spillway-op-trace v1 model\n"}) {
    CAPTURE(header);
    CHECK_THROWS_AS((void)parse_op_trace(header, "h"), spillway::invalid_argument);
  }
}

TEST_CASE("the writer refuses what the reader would") {
  trace_data t = tiny();
  t.ops[1].inputs.push_back(2);  // op b reads its own output
  CHECK_THROWS_AS((void)to_text(t), spillway::invalid_argument);
  t = tiny();
  t.model = "two words";
  CHECK_THROWS_AS((void)to_text(t), spillway::invalid_argument);
  t = tiny();
  t.buffers[1].free_after = 0;  // freed after op a, but op b reads it
  CHECK_THROWS_AS((void)to_text(t), spillway::invalid_argument);
}

TEST_CASE("liveness: parameters live to the end, frees and last uses end the others") {
  const trace_data t = tiny();
  const liveness l = compute_liveness(t);
  CHECK(l.produced_by == std::vector<std::size_t>{never, 0, 1, 2});
  CHECK(l.dies_after == std::vector<std::size_t>{never, 1, 2, 2});  // 11: its f; 12: last use; 13: unused
  CHECK(t.backward_begin() == 2);
  const trace_summary s = summarize(t);
  CHECK(s.total_duration_ns == 600);
  CHECK(s.forward_duration_ns == 300);
  CHECK(s.peak_live_bytes == 4096 + 1024 + 1024);
  CHECK(s.params == 1);
}

TEST_CASE("the derived backward reads what the forward saved and sums gradients of shared buffers") {
  step_builder s(1000, 10);
  const step_builder::value w = s.weight(64);
  const step_builder::value x = s.input(32);
  const step_builder::value h = s.op1("lin", 100, {x, w}, 32, saved::inputs, 200);
  const step_builder::value r = s.op1("relu", 10, {h}, 32, saved::outputs, 20);
  const step_builder::value sum = s.op1("add", 10, {h, r}, 32, saved::nothing, 20);  // h used twice
  const trace_data t = s.finish(sum, "toy", "test");
  const auto find = [&](const std::string& name) -> const op& {
    for (const op& o : t.ops) {
      if (o.name == name) return o;
    }
    FAIL("no op " << name);
    return t.ops.front();
  };
  CHECK(find("relu.bwd").inputs.size() == 2);  // its output gradient and its output
  CHECK(std::find(find("relu.bwd").inputs.begin(), find("relu.bwd").inputs.end(), r) != find("relu.bwd").inputs.end());
  CHECK(find("add.bwd").outputs.size() == 2);  // gradients of h and r
  CHECK(find("relu.acc").inputs.size() == 2);  // h's two partial gradients, summed after relu.bwd
  CHECK(find("lin.bwd").outputs.empty());      // x is an input, w accumulates in place
  CHECK(std::find(find("lin.bwd").inputs.begin(), find("lin.bwd").inputs.end(), x) != find("lin.bwd").inputs.end());
  CHECK(t.buffers[w + 1].param);  // w's gradient buffer
  CHECK(parse_op_trace(to_text(t)) == t);
}
