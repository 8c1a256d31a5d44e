// engine_fixture: the eviction engine on the simulated device, and deterministic kernels that feed
// and check it through the sim's host-visible memory.
//
//   engine_env env({.budget = 2 * MiB});        // sim (manual clock) + allocator + engine
//   lineage_graph g(env);
//   buffer_id x = g.source(16 * KiB);           // filled by a kernel; no lineage: spill only
//   buffer_id y = g.node({x}, {16 * KiB})[0];   // computed once by the test, then the engine's
//   g.expect(y);                                // pin, check in stream order, unpin
//   env.sim->run_until_idle();
//   env.check_clean();                          // no kernel saw a wrong byte, no handler failed
//
// - Buffers are arrays of 64-bit words (sizes are multiples of 8). Output k of a node is, word by
//   word, mix(seed, k, w) + the sum over its inputs of in[w mod words(in)]: deterministic, so a
//   recompute reproduces it bit for bit. The host keeps a golden copy and checksum of every
//   buffer (checksum: FNV-1a over 64-bit words).
// - Every data access is a kernel on the sim, so it happens in stream order when the kernel
//   completes, as on a GPU: sources are filled by a kernel; a node's kernel first verifies the
//   checksum of each input (so a test sees, from inside the node, that its inputs were
//   rematerialised and still intact while it ran) and then writes its outputs; a check kernel
//   compares a buffer's checksum with the golden one. Failures are collected thread-safely in a
//   kernel_log and asserted by the test.
// - Teardown order: engine, then the sim's pending work, then allocator, then streams.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "allocator_checks.hpp"
#include "backend_fixture.hpp"
#include "spillway/device_allocator.hpp"
#include "spillway/errors.hpp"
#include "spillway/eviction/engine.hpp"
#include "spillway/sim_device.hpp"

namespace spillway::test {

using eviction::buffer_id;
using eviction::buffer_options;
using eviction::buffer_state;
using eviction::eviction_engine;
using eviction::eviction_mode;
using eviction::lineage_node;
using eviction::node_id;
using eviction::pinned_buffer;

// FNV-1a over 64-bit words (then the tail bytes): a host-side reduction of the sim's memory.
inline std::uint64_t checksum(const void* p, std::size_t bytes) noexcept {
  constexpr std::uint64_t prime = 1099511628211ull;
  std::uint64_t h = 14695981039346656037ull;
  const auto* b = static_cast<const unsigned char*>(p);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * prime;
  }
  for (; i < bytes; ++i) h = (h ^ b[i]) * prime;
  return h;
}

inline std::uint64_t mix_word(std::uint64_t seed, std::uint64_t k, std::uint64_t w) noexcept {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + k * 0xD1B54A32D192ED03ull + w;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

// The node function, on host memory (golden copies) and on the sim's device memory alike.
inline void compute_words(std::uint64_t seed, std::span<const std::uint64_t* const> in,
                          std::span<const std::size_t> in_words,
                          std::span<std::uint64_t* const> out,
                          std::span<const std::size_t> out_words) {
  for (std::size_t k = 0; k < out.size(); ++k) {
    for (std::size_t w = 0; w < out_words[k]; ++w) {
      std::uint64_t v = mix_word(seed, k, w);
      for (std::size_t j = 0; j < in.size(); ++j) v += in[j][w % in_words[j]];
      out[k][w] = v;
    }
  }
}

// What kernels found wrong; thread-safe (effects run on whichever thread advances the sim).
class kernel_log {
 public:
  void fail(std::string what) const {
    std::lock_guard lock(state_->mutex);
    state_->failures.push_back(std::move(what));
  }
  void count_check() const noexcept { state_->checks.fetch_add(1, std::memory_order_relaxed); }
  std::vector<std::string> failures() const {
    std::lock_guard lock(state_->mutex);
    return state_->failures;
  }
  std::uint64_t checks() const noexcept { return state_->checks.load(std::memory_order_relaxed); }

 private:
  struct state {
    mutable std::mutex mutex;
    std::vector<std::string> failures;
    std::atomic<std::uint64_t> checks{0};
  };
  std::shared_ptr<state> state_ = std::make_shared<state>();
};

struct engine_options {
  std::size_t capacity = 256 * MiB;
  std::size_t budget = unlimited_budget;
  clock_mode clock = clock_mode::manual;
  double time_scale = 1.0;
  double h2d_bandwidth = 50e9;
  double d2h_bandwidth = 50e9;
  int streams = 1;  // created besides the default stream (streams[0] is the first created)
  bool expandable_segments = false;
  eviction::engine_config engine{};  // an empty clock is replaced by the sim's
  // What the allocator sees of the sim (default: the sim itself), e.g. a decorator of it.
  std::function<std::shared_ptr<device_backend>(std::shared_ptr<sim_device>)> backend;
};

struct engine_env {
  std::shared_ptr<sim_device> sim;
  warning_log warnings;
  std::vector<stream_ref> streams;
  std::unique_ptr<device_allocator> alloc;
  std::unique_ptr<eviction_engine> engine;
  kernel_log log;

  explicit engine_env(engine_options o = {}) {
    sim_config sc;
    sc.capacity = o.capacity;
    sc.clock = o.clock;
    sc.time_scale = o.time_scale;
    sc.h2d_bandwidth = o.h2d_bandwidth;
    sc.d2h_bandwidth = o.d2h_bandwidth;
    sim = std::make_shared<sim_device>(sc);
    for (int i = 0; i < o.streams; ++i) streams.push_back(sim->create_stream());
    allocator_config ac;
    ac.budget = o.budget;
    ac.expandable_segments = o.expandable_segments;
    ac.on_warning = warnings.sink();
    alloc = std::make_unique<device_allocator>(o.backend ? o.backend(sim) : sim, ac);
    if (!o.engine.clock) o.engine.clock = [s = sim.get()] { return s->now_ns(); };
    engine = std::make_unique<eviction_engine>(*alloc, std::move(o.engine));
  }
  engine_env(const engine_env&) = delete;
  engine_env& operator=(const engine_env&) = delete;
  ~engine_env() {
    engine.reset();
    try {
      sim->run_until_idle();
    } catch (...) {
    }
    alloc.reset();
    for (stream_ref s : streams) sim->destroy_stream(s);
  }

  stream_ref stream(std::size_t i = 0) const { return streams.at(i); }
  eviction_engine& eng() const { return *engine; }

  // Kernel failures, pressure handler failures (reported by the allocator through on_warning),
  // releases of device or pinned memory that was not live (a double release), and copies whose
  // source was written while they ran (a missing stream wait).
  void check_clean() const {
    for (const std::string& f : log.failures()) FAIL_CHECK("kernel: " << f);
    CHECK(sim->counters().invalid_releases == 0);
    CHECK(sim->counters().copy_sources_changed == 0);
    for (const std::string& w : warnings.messages()) {
      CHECK_MESSAGE(!contains(w, "pressure handler"), w);
    }
  }
  std::size_t allocated_bytes() const {
    return static_cast<std::size_t>(alloc->stats().allocated_bytes[0].current);
  }
};

// Buffers with lineage on an engine, with their golden bytes.
class lineage_graph {
 public:
  struct buffer_record {
    buffer_id id;
    std::size_t bytes = 0;
    stream_ref stream;
    std::shared_ptr<const std::vector<std::uint64_t>> golden;
    std::uint64_t sum = 0;
    int node = -1;  // index into nodes(), -1 for a source
    std::uint32_t output_index = 0;
  };
  struct node_record {
    node_id id;
    std::string name;
    std::vector<int> inputs;   // indices into buffers()
    std::vector<int> outputs;
    std::shared_ptr<std::atomic<std::uint64_t>> runs;  // compute calls, the test's first included
  };

  explicit lineage_graph(engine_env& env, std::uint64_t kernel_ns = 1000)
      : env_(env), kernel_ns_(kernel_ns) {}

  const std::vector<buffer_record>& buffers() const noexcept { return buffers_; }
  const std::vector<node_record>& nodes() const noexcept { return nodes_; }
  const buffer_record& at(buffer_id id) const {
    for (const buffer_record& b : buffers_) {
      if (b.id == id) return b;
    }
    FAIL("unknown buffer " << id.value);
    return buffers_.front();
  }
  std::uint64_t runs(node_id n) const {
    for (const node_record& r : nodes_) {
      if (r.id == n) return r.runs->load();
    }
    FAIL("unknown node " << n.value);
    return 0;
  }

  // A buffer without lineage, filled by a kernel on `s` with a pattern of `seed`.
  buffer_id source(std::size_t bytes, stream_ref s = {}, buffer_options options = {},
                   std::uint64_t seed = 0) {
    REQUIRE(bytes % 8 == 0);
    auto golden = std::make_shared<std::vector<std::uint64_t>>(bytes / 8);
    const std::uint64_t k = seed != 0 ? seed : 0x5eed0000 + buffers_.size();
    for (std::size_t w = 0; w < golden->size(); ++w) (*golden)[w] = mix_word(k, 99, w);
    void* p = env_.alloc->allocate(bytes, s);
    env_.sim->launch(s, kernel_ns_, [p, golden] {
      std::memcpy(p, golden->data(), golden->size() * 8);
    });
    buffer_record r;
    r.id = env_.engine->register_buffer(p, bytes, s, options);
    r.bytes = bytes;
    r.stream = s;
    r.sum = checksum(golden->data(), bytes);
    r.golden = std::move(golden);
    buffers_.push_back(std::move(r));
    return buffers_.back().id;
  }

  // The compute callable of a node: checks its inputs in its kernel, then writes its outputs.
  eviction::compute_fn kernel(std::string name, std::uint64_t seed,
                              const std::vector<buffer_id>& inputs,
                              const std::vector<std::size_t>& output_bytes,
                              std::shared_ptr<std::atomic<std::uint64_t>> runs) {
    std::vector<std::size_t> in_words, in_bytes, out_words;
    std::vector<std::uint64_t> in_sums;
    for (buffer_id in : inputs) {
      const buffer_record& r = at(in);
      in_words.push_back(r.bytes / 8);
      in_bytes.push_back(r.bytes);
      in_sums.push_back(r.sum);
    }
    for (std::size_t b : output_bytes) out_words.push_back(b / 8);
    sim_device* sim = env_.sim.get();
    kernel_log log = env_.log;
    const std::uint64_t ns = kernel_ns_;
    return [=](std::span<void* const> in, std::span<void* const> out, stream_ref s) {
      runs->fetch_add(1);
      if (in.size() != in_words.size() || out.size() != out_words.size()) {
        log.fail(name + ": called with " + std::to_string(in.size()) + " inputs, " +
                             std::to_string(out.size()) + " outputs");
        return;
      }
      std::vector<void*> in_ptrs(in.begin(), in.end()), out_ptrs(out.begin(), out.end());
      sim->launch(s, ns, [=]() mutable {
        for (std::size_t j = 0; j < in_ptrs.size(); ++j) {
          if (checksum(in_ptrs[j], in_bytes[j]) != in_sums[j]) {
            log.fail(name + ": input " + std::to_string(j) + " was wrong when the node ran");
          }
          // An input evicted while the node was being set up could lend its block to an output.
          const auto* in_lo = static_cast<const char*>(in_ptrs[j]);
          for (std::size_t k = 0; k < out_ptrs.size(); ++k) {
            const auto* out_lo = static_cast<const char*>(out_ptrs[k]);
            if (in_lo < out_lo + out_words[k] * 8 && out_lo < in_lo + in_bytes[j]) {
              log.fail(name + ": input " + std::to_string(j) + " overlaps output " +
                       std::to_string(k));
            }
          }
        }
        std::vector<const std::uint64_t*> ins;
        std::vector<std::uint64_t*> outs;
        for (void* p : in_ptrs) ins.push_back(static_cast<const std::uint64_t*>(p));
        for (void* p : out_ptrs) outs.push_back(static_cast<std::uint64_t*>(p));
        compute_words(seed, ins, in_words, outs, out_words);
      });
    };
  }

  // A node over `inputs` with outputs of `output_bytes`, on stream `s`. The test computes it once
  // (inputs pinned for `s`, outputs allocated on `s`), then records the node and registers the
  // outputs with it as producer, as a framework records an op that succeeded; `options[k]` (if
  // given) are the other options of output k; output k lives on `output_streams[k]` (if given;
  // else on `s`), which waits for `s` after the first computation. Returns the outputs. On
  // out_of_memory (pinning an input, allocating an output) nothing is left behind.
  std::vector<buffer_id> node(const std::vector<buffer_id>& inputs,
                              const std::vector<std::size_t>& output_bytes, stream_ref s = {},
                              double cost_ns = 1000, std::vector<buffer_options> options = {},
                              std::vector<stream_ref> output_streams = {}) {
    output_streams.resize(output_bytes.size(), s);
    const std::size_t index = nodes_.size();
    const std::uint64_t seed = 0xC0DE0000 + index;
    node_record nr;
    nr.name = "n" + std::to_string(index);
    nr.runs = std::make_shared<std::atomic<std::uint64_t>>(0);
    for (buffer_id in : inputs) nr.inputs.push_back(index_of(in));
    lineage_node desc;
    desc.name = nr.name;
    desc.inputs = inputs;
    desc.output_count = output_bytes.size();
    desc.compute = kernel(nr.name, seed, inputs, output_bytes, nr.runs);
    desc.cost_ns = cost_ns;

    // Golden outputs on the host.
    std::vector<std::shared_ptr<std::vector<std::uint64_t>>> golden;
    std::vector<const std::uint64_t*> ins;
    std::vector<std::size_t> in_words, out_words;
    std::vector<std::uint64_t*> outs;
    for (buffer_id in : inputs) {
      ins.push_back(at(in).golden->data());
      in_words.push_back(at(in).bytes / 8);
    }
    for (std::size_t b : output_bytes) {
      REQUIRE(b % 8 == 0);
      golden.push_back(std::make_shared<std::vector<std::uint64_t>>(b / 8));
      outs.push_back(golden.back()->data());
      out_words.push_back(b / 8);
    }
    compute_words(seed, ins, in_words, outs, out_words);

    // The first computation, by the test, as a framework would run the op.
    std::vector<pinned_buffer> pins;
    std::vector<void*> in_ptrs, out_ptrs;
    for (buffer_id in : inputs) {
      pins.push_back(env_.engine->pin(in, s));
      in_ptrs.push_back(pins.back().get());
    }
    try {
      for (std::size_t k = 0; k < output_bytes.size(); ++k) {
        out_ptrs.push_back(env_.alloc->allocate(output_bytes[k], output_streams[k]));
      }
    } catch (...) {
      for (void* p : out_ptrs) env_.alloc->deallocate(p);
      throw;
    }
    desc.compute(in_ptrs, out_ptrs, s);
    for (std::size_t k = 0; k < output_bytes.size(); ++k) {
      if (output_streams[k] == s) continue;
      env_.alloc->record_stream(out_ptrs[k], s);  // written on s
      const event_ref written = env_.sim->create_event();
      env_.sim->record_event(written, s);
      env_.sim->stream_wait_event(output_streams[k], written);
      env_.sim->destroy_event(written);
    }
    nr.id = env_.engine->add_node(std::move(desc));
    std::vector<buffer_id> ids;
    for (std::size_t k = 0; k < output_bytes.size(); ++k) {
      buffer_options o = k < options.size() ? options[k] : buffer_options{};
      o.producer = nr.id;
      o.output_index = static_cast<std::uint32_t>(k);
      buffer_record r;
      r.id = env_.engine->register_buffer(out_ptrs[k], output_bytes[k], output_streams[k], o);
      r.bytes = output_bytes[k];
      r.stream = output_streams[k];
      r.sum = checksum(golden[k]->data(), output_bytes[k]);
      r.golden = golden[k];
      r.node = static_cast<int>(index);
      r.output_index = static_cast<std::uint32_t>(k);
      nr.outputs.push_back(static_cast<int>(buffers_.size()));
      buffers_.push_back(std::move(r));
      ids.push_back(buffers_.back().id);
    }
    pins.clear();  // unpinned after the kernel that reads them was enqueued on `s`
    nodes_.push_back(std::move(nr));
    return ids;
  }

  // A chain s -> x1 -> ... -> xn of buffers of `bytes` on the default stream: s first.
  std::vector<buffer_id> chain(int n, std::size_t bytes) {
    std::vector<buffer_id> ids{source(bytes)};
    for (int i = 0; i < n; ++i) ids.push_back(node({ids.back()}, {bytes})[0]);
    return ids;
  }

  // Enqueues on `s` a kernel that checks the bytes at `ptr` against the golden copy of `id` when it
  // completes, `duration_ns` (default: the graph's kernel time) after it starts.
  void check_kernel(buffer_id id, const void* ptr, stream_ref s, std::string tag = {},
                    std::uint64_t duration_ns = 0) {
    const buffer_record& r = at(id);
    kernel_log log = env_.log;
    const std::uint64_t sum = r.sum;
    const std::size_t bytes = r.bytes;
    if (tag.empty()) tag = "buffer " + std::to_string(id.value);
    env_.sim->launch(s, duration_ns != 0 ? duration_ns : kernel_ns_, [=]() mutable {
      log.count_check();
      if (checksum(ptr, bytes) != sum) log.fail(tag + ": wrong bytes");
    });
  }

  // Pins `id`, enqueues a check on its stream, unpins: the bytes are checked in stream order.
  void expect(buffer_id id, std::string tag = {}) {
    pinned_buffer p = env_.engine->pin(id);
    check_kernel(id, p.get(), at(id).stream, std::move(tag));
  }

  // Pins `id`, waits for its stream and compares the bytes on the host now. Returns the pin.
  pinned_buffer expect_now(buffer_id id) {
    pinned_buffer p = env_.engine->pin(id);
    env_.sim->synchronize_stream(at(id).stream);
    CHECK_MESSAGE(checksum(p.get(), at(id).bytes) == at(id).sum, "buffer " << id.value);
    return p;
  }

  // Forgets `id` in the engine and here: it is no longer checked. The nodes' index lists lose it
  // (-1 where it was).
  void forget(buffer_id id) {
    const int i = index_of(id);
    env_.engine->forget(id);
    buffers_.erase(buffers_.begin() + i);
    for (node_record& n : nodes_) {
      for (std::vector<int>* list : {&n.inputs, &n.outputs}) {
        for (int& j : *list) j = j == i ? -1 : j > i ? j - 1 : j;
      }
    }
  }

  // Forgets every buffer of the graph that is still registered (in reverse order).
  void forget_all() {
    for (auto it = buffers_.rbegin(); it != buffers_.rend(); ++it) env_.engine->forget(it->id);
    buffers_.clear();
    nodes_.clear();
  }

  int index_of(buffer_id id) const {
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].id == id) return static_cast<int>(i);
    }
    FAIL("unknown buffer " << id.value);
    return -1;
  }

 private:
  engine_env& env_;
  std::uint64_t kernel_ns_;
  std::vector<buffer_record> buffers_;
  std::vector<node_record> nodes_;
};

// Drops `id` now (it must be droppable).
inline void drop(eviction_engine& e, buffer_id id) {
  REQUIRE(e.evict(id, eviction_mode::drop));
  REQUIRE(e.state(id) == buffer_state::dropped);
}

// x1 = f(x0), x2 = g(x1), x3 = k(x2), x4 = h(x1, x3) (x0 256 KiB, x1 512, x2 1024, x3 512, x4 256),
// x1..x4 dropped, then a 2 MiB budget: one small segment. Rematerialising x4 runs f, g, k, h and
// holds x1 from f until h reads it; at k, x0 + x1 + x2 + x3 exceed 2 MiB, so the plan must let x1
// go (Note [Recompute plans hold their outputs]) and h brings it back with a plan of its own.
// The engine must not spill (allow_spill false). Returns x0..x4.
inline std::vector<buffer_id> held_outputs_graph(engine_env& env, lineage_graph& g) {
  const buffer_id x0 = g.source(256 * KiB);
  const buffer_id x1 = g.node({x0}, {512 * KiB})[0];
  const buffer_id x2 = g.node({x1}, {MiB})[0];
  const buffer_id x3 = g.node({x2}, {512 * KiB})[0];
  const buffer_id x4 = g.node({x1, x3}, {256 * KiB})[0];
  env.sim->run_until_idle();
  for (buffer_id id : {x1, x2, x3, x4}) drop(env.eng(), id);
  env.alloc->set_budget(2 * MiB);
  REQUIRE(env.alloc->stats().reserved_bytes[0].current == static_cast<std::int64_t>(2 * MiB));
  return {x0, x1, x2, x3, x4};
}

}  // namespace spillway::test
