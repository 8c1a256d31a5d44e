// test_trace_format: the alloc/free trace format (bench/trace_format.hpp, docs/trace_format.md),
// its synthetic generator and its player.
//
// It proves: a trace survives write + read unchanged, plain and gzip, and the writer is
// deterministic; comments, blank lines, CRLF and tabs are accepted; every kind of bad input
// (unknown op, free / record_stream of an id that is not live, an alloc of a live id, a free on
// the wrong stream, negative, garbage and out-of-range numbers, time going backwards, a size of 0,
// a bad or missing header, a corrupt gzip file) is refused with spillway::invalid_argument naming
// the line number and the line's text, and the writer refuses what the reader would; the
// synthetic models are deterministic per seed; and replaying a small handwritten trace on the
// simulated device gives exactly the peaks the size table predicts (Note [Size table]), with OOMs
// counted and the OOM'd id's later events skipped.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "spillway/errors.hpp"
#include "spillway/size_classes.hpp"
#include "trace_builder.hpp"
#include "trace_format.hpp"
#include "trace_gzip.hpp"
#include "trace_models.hpp"
#include "trace_player.hpp"

using namespace spillway;
using namespace spillway::trace;

// Failed checks print events as their trace line.
template <>
struct doctest::StringMaker<event> {
  static String convert(const event& e) {
    std::string s = std::to_string(e.t_ns) + " " + static_cast<char>(e.kind) + " " + std::to_string(e.id) + " ";
    if (e.kind == op::alloc) s += std::to_string(e.size) + " ";
    return (s + std::to_string(e.stream)).c_str();
  }
};
namespace sc = spillway::size_classes;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// A directory of its own under the system's temporary directory, removed at the end of a case.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    path = std::filesystem::temp_directory_path() /
           ("spillway-trace-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

const std::string head = "# spillway-trace v1 device_capacity=1073741824 source=test\n";

// The message parse_trace throws for `text`, or "" when it parses.
std::string error_of(const std::string& text) {
  try {
    parse_trace(text, "t.trace");
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

trace_data sample_trace() {
  header h;
  h.device_capacity = std::size_t{80} << 30;
  h.source = "sample:unit-test";
  h.torch_peak_reserved = 123456789;
  h.extra = {{"model", "resnet50"}, {"note", "a=b"}};
  trace_builder b(h);
  const auto a = b.alloc(1000, 0);
  b.advance(10);
  const auto c = b.alloc(std::size_t{3} << 20, 1);
  b.record_stream(c, 0);
  b.advance(5);
  b.free(a);
  const auto d = b.alloc(7, 0);  // reuses id 0
  b.advance(1);
  b.free(c);
  b.free(d);
  b.alloc(sc::max_request_size, 2);
  return b.finish();
}

}  // namespace

TEST_CASE("a trace survives write and read, plain and gzip") {
  temp_dir dir;
  const trace_data t = sample_trace();
  REQUIRE(t.events.size() == 8);
  CHECK(t.events[4] == event{15, 7, 0, 0, op::alloc});  // the lowest free id is reused

  SUBCASE("in memory") { CHECK(parse_trace(to_text(t)) == t); }
  SUBCASE("plain file") {
    write_trace(t, dir.file("x.trace"));
    CHECK(!is_gzip_file(dir.file("x.trace")));
    CHECK(read_trace(dir.file("x.trace")) == t);
  }
  SUBCASE("gzip file, recognised by content, deterministic bytes") {
    write_trace(t, dir.file("x.trace.gz"));
    CHECK(read_trace(dir.file("x.trace.gz")) == t);
    std::filesystem::copy_file(dir.file("x.trace.gz"), dir.file("renamed.txt"));
    CHECK(read_trace(dir.file("renamed.txt")) == t);
    write_trace(t, dir.file("y.trace.gz"));
    std::ifstream a(dir.file("x.trace.gz"), std::ios::binary), b(dir.file("y.trace.gz"), std::ios::binary);
    const std::string ba((std::istreambuf_iterator<char>(a)), {}), bb((std::istreambuf_iterator<char>(b)), {});
    CHECK(ba == bb);
    CHECK(!std::filesystem::exists(dir.file("x.trace")));  // no temporary left behind
  }
  SUBCASE("the text is what docs/trace_format.md shows") {
    const std::string text = to_text(t);
    CHECK(text.rfind("# spillway-trace v1 device_capacity=85899345920 source=sample:unit-test "
                     "torch_peak_reserved=123456789 model=resnet50 note=a=b\n0 a 0 1000 0\n10 a 1 3145728 1\n"
                     "10 r 1 0\n15 f 0 0\n",
                     0) == 0);
  }
}

TEST_CASE("the reader accepts comments, blank lines, CRLF and tabs") {
  const trace_data t = parse_trace(head + "# a comment\n\n0 a 0 512 0\r\n5\tf\t0  0\n   \n# end\n");
  REQUIRE(t.events.size() == 2);
  CHECK(t.events[1] == event{5, 0, 0, 0, op::free});
  CHECK(t.head.device_capacity == std::size_t{1} << 30);
  CHECK(t.head.source == "test");
  CHECK(!t.head.torch_peak_reserved);
  CHECK(parse_trace(head).events.empty());
}

TEST_CASE("bad input names the file, the line number and the line") {
  struct bad_case {
    const char* name;
    std::string body;        // lines after the header
    std::string line_ref;    // "t.trace:<line>"
    std::string problem;     // part of the message
    std::string text;        // the quoted line
  };
  const bad_case cases[] = {
      {"unknown op", "0 a 0 512 0\n1 x 0 0\n", "t.trace:3", "unknown op \"x\"", "\"1 x 0 0\""},
      {"free of an unknown id", "0 a 0 512 0\n1 f 7 0\n", "t.trace:3", "free of id 7, which is not live", "\"1 f 7 0\""},
      {"double free", "0 a 0 512 0\n1 f 0 0\n2 f 0 0\n", "t.trace:4", "free of id 0, which is not live", "\"2 f 0 0\""},
      {"alloc of a live id", "0 a 3 512 0\n1 a 3 512 0\n", "t.trace:3", "alloc of id 3, which is already live",
       "\"1 a 3 512 0\""},
      {"record_stream of an unknown id", "0 r 4 1\n", "t.trace:2", "record_stream of id 4, which is not live", "\"0 r 4 1\""},
      {"free on another stream", "0 a 0 512 1\n1 f 0 0\n", "t.trace:3", "allocated on stream 1", "\"1 f 0 0\""},
      {"negative size", "0 a 0 -512 0\n", "t.trace:2", "size \"-512\" is negative", "\"0 a 0 -512 0\""},
      {"negative time", "-5 a 0 512 0\n", "t.trace:2", "time \"-5\" is negative", "\"-5 a 0 512 0\""},
      {"garbage size", "0 a 0 12abc 0\n", "t.trace:2", "size \"12abc\" is not a number", "\"0 a 0 12abc 0\""},
      {"garbage id", "0 f x 0\n", "t.trace:2", "id \"x\" is not a number", "\"0 f x 0\""},
      {"out of range time", "99999999999999999999 a 0 512 0\n", "t.trace:2", "is out of range", "99999999999999999999"},
      {"id above the limit", "0 a 16777216 512 0\n", "t.trace:2", "id 16777216 is above the limit", "\"0 a 16777216 512 0\""},
      {"stream above the limit", "0 a 0 512 65536\n", "t.trace:2", "stream 65536 is above the limit", "\"0 a 0 512 65536\""},
      {"size 0", "0 a 0 0 0\n", "t.trace:2", "an allocation of 0 bytes", "\"0 a 0 0 0\""},
      {"size above the largest request", "0 a 0 281474976710657 0\n", "t.trace:2", "above the largest request",
       "\"0 a 0 281474976710657 0\""},
      {"time going backwards", "10 a 0 512 0\n9 f 0 0\n", "t.trace:3", "time goes backwards", "\"9 f 0 0\""},
      {"missing field", "0 a 0 512\n", "t.trace:2", "op a takes 5 fields, found 4", "\"0 a 0 512\""},
      {"extra field", "0 a 0 512 0\n1 f 0 0 0\n", "t.trace:3", "op f takes 4 fields, found 5", "\"1 f 0 0 0\""},
      {"a long op", "0 alloc 0 512 0\n", "t.trace:2", "expected \"<t_ns> <op> ...\"", "\"0 alloc 0 512 0\""},
  };
  for (const bad_case& c : cases) {
    CAPTURE(c.name);
    const std::string message = error_of(head + c.body);
    CHECK(contains(message, c.line_ref + ":"));
    CHECK(contains(message, c.problem));
    CHECK(contains(message, c.text));
  }
}

TEST_CASE("a bad or missing header is refused") {
  CHECK(contains(error_of(""), "t.trace:1: empty file"));
  CHECK(contains(error_of("0 a 0 512 0\n"), "t.trace:1: not a spillway trace"));
  CHECK(contains(error_of("# spillway-trace v2 source=x\n"), "unsupported trace version"));
  CHECK(contains(error_of("# spillway-trace v1 capacity\n"), "header field \"capacity\" is not key=value"));
  CHECK(contains(error_of("# spillway-trace v1 device_capacity=lots\n"),
                 "device_capacity \"lots\" is not a number in \"# spillway-trace v1 device_capacity=lots\""));
  CHECK(contains(error_of("# spillway-trace v1 torch_peak_reserved=-1\n"), "torch_peak_reserved \"-1\" is negative"));
}

TEST_CASE("a corrupt or missing file is refused with a clear message") {
  temp_dir dir;
  {
    std::ofstream out(dir.file("bad.trace.gz"), std::ios::binary);
    out << "\x1f\x8b" << "this is not deflate data";
  }
  try {
    read_trace(dir.file("bad.trace.gz"));
    FAIL("a corrupt gzip file was accepted");
  } catch (const spillway::invalid_argument& e) {
    CHECK(contains(e.what(), "cannot decompress"));
    CHECK(contains(e.what(), "bad.trace.gz"));
  }
  CHECK_THROWS_AS(read_trace(dir.file("missing.trace")), spillway::invalid_argument);
}

TEST_CASE("the writer refuses what the reader would refuse") {
  trace_data t;
  t.head.source = "x";
  t.events = {{0, 512, 0, 0, op::alloc}, {1, 0, 1, 0, op::free}};
  try {
    (void)to_text(t);
    FAIL("an invalid trace was written");
  } catch (const spillway::invalid_argument& e) {
    CHECK(contains(e.what(), "trace event 1: free of id 1, which is not live"));
  }
  t.events.clear();
  t.head.source = "two words";
  CHECK_THROWS_AS((void)to_text(t), spillway::invalid_argument);
  t.head.source = "x";
  t.head.extra = {{"source", "y"}};
  CHECK_THROWS_AS((void)to_text(t), spillway::invalid_argument);
}

TEST_CASE("the synthetic models are deterministic and valid") {
  for (const char* model : {"transformer", "cnn", "random"}) {
    CAPTURE(model);
    synth_options o;
    o.model = model;
    o.iterations = 2, o.layers = 2, o.batch = 2, o.seq = 64, o.hidden = 64, o.heads = 4, o.vocab = 100;
    o.image = 64, o.width = 8, o.events = 500, o.live_bytes = 16 * MiB;
    const trace_data a = synthesize(o);
    CHECK(a == synthesize(o));
    CHECK(parse_trace(to_text(a)) == a);
    const trace_summary s = summarize(a);
    CHECK(s.allocs > 0);
    CHECK(s.frees > 0);
    CHECK(s.streams >= 2);  // a second stream (the loader's, or the random streams)
    o.seed = 2;
    if (std::string(model) != "cnn") CHECK(!(synthesize(o) == a));  // cnn shapes do not depend on the seed
  }
  synth_options bad;
  bad.model = "lstm";
  CHECK_THROWS_AS(synthesize(bad), spillway::invalid_argument);
  bad.model = "transformer";
  bad.heads = 7;
  CHECK_THROWS_AS(synthesize(bad), spillway::invalid_argument);
}

TEST_CASE("replaying a handwritten trace on the simulated device gives the size table's peaks") {
  // id 0: 1000 B, small pool -> 1024 B in a fresh 2 MiB segment.
  // id 1: 3 MiB, large pool -> a fresh 20 MiB segment, split: 17 MiB stay cached.
  // id 0 freed; id 2: 15 MiB fits the cached 17 MiB (split again: 2 MiB > 1 MiB remain).
  // id 3: 1000 B on stream 1, which cannot reuse stream 0's small segment -> another 2 MiB.
  const trace_data t = parse_trace(head +
                                   "0 a 0 1000 0\n"
                                   "10 a 1 3145728 0\n"
                                   "20 f 0 0\n"
                                   "30 a 2 15728640 0\n"
                                   "40 a 3 1000 1\n"
                                   "50 r 1 1\n"
                                   "60 f 1 0\n"
                                   "70 f 2 0\n"
                                   "80 f 3 1\n");
  const std::size_t small = sc::round_size(1000);
  REQUIRE(small == 1024);
  REQUIRE(sc::segment_size(small) == 2 * MiB);
  REQUIRE(sc::segment_size(sc::round_size(3 * MiB)) == 20 * MiB);
  REQUIRE(sc::should_split(17 * MiB, sc::round_size(15 * MiB)));

  replay_options o;
  o.device = "sim";
  const replay_result r = replay(t, o);
  CHECK(r.device_kind == "sim");
  CHECK(r.capacity == std::size_t{1} << 30);  // from the header
  CHECK(r.peak_allocated == static_cast<std::int64_t>(3 * MiB + 15 * MiB + small));
  CHECK(r.peak_requested == static_cast<std::int64_t>(3 * MiB + 15 * MiB + 1000));
  CHECK(r.peak_reserved == static_cast<std::int64_t>(2 * MiB + 20 * MiB + 2 * MiB));
  CHECK(r.peak_segments == 3);
  CHECK(r.device_allocs == 3);
  CHECK(r.ooms == 0);
  CHECK(r.skipped == 0);
  CHECK(r.warnings == 0);
  CHECK(r.fragmentation() == doctest::Approx(24.0 / (18.0 + 1024.0 / MiB)));
  CHECK(!r.torch_fragmentation());

  SUBCASE("expandable segments: one segment per (pool, stream), grown in 2 MiB pages") {
    o.expandable = true;
    const replay_result e = replay(t, o);
    CHECK(e.peak_allocated >= r.peak_allocated);
    CHECK(e.peak_reserved <= r.peak_reserved);
    CHECK(e.ooms == 0);
  }
}

TEST_CASE("an allocation that does not fit is counted and its later events are skipped") {
  const trace_data t = parse_trace(
      "# spillway-trace v1 device_capacity=8388608 source=test torch_peak_reserved=4194304\n"
      "0 a 0 16777216 0\n"   // 16 MiB on an 8 MiB device: out of memory
      "1 a 1 1000 0\n"
      "2 r 0 1\n"            // skipped
      "3 f 0 0\n"            // skipped
      "4 f 1 0\n");
  replay_options o;
  o.device = "sim";
  const replay_result r = replay(t, o);
  CHECK(r.capacity == 8 * MiB);
  CHECK(r.ooms == 1);
  CHECK(r.skipped == 2);
  CHECK(r.peak_allocated == 1024);
  CHECK(r.peak_reserved == static_cast<std::int64_t>(2 * MiB));
  REQUIRE(r.torch_fragmentation());
  CHECK(*r.torch_fragmentation() == doctest::Approx(4.0 * MiB / 1024));

  o.capacity = 64 * MiB;  // --capacity overrides the header
  const replay_result big = replay(t, o);
  CHECK(big.capacity == 64 * MiB);
  CHECK(big.ooms == 0);
}
