// stress_sim_work.cpp: stress_work on the simulated device. See stress_work.hpp.
//
// fill and verify touch the block from the host at once, which is in stream order for the
// allocation's own stream only because the stress run never enqueues work that touches a block on
// its own stream. Work on other streams is a launch()ed kernel whose effect checks the pattern when
// the kernel completes: if the allocator handed the block to someone else before that stream was
// done with it, the new owner's pattern is what the kernel finds.
#include <algorithm>
#include <atomic>

#include "stress_work.hpp"

namespace spillway::bench {
namespace {

constexpr std::size_t edge_bytes = 64;   // head and tail
constexpr std::size_t probe_bytes = 16;  // each of the probes in between
constexpr int probes = 4;

// Calls f(offset, length) for each patterned range of an allocation of `bytes` (ranges may
// overlap for small blocks; they carry the same bytes then).
template <class F>
void for_each_range(std::size_t bytes, F&& f) {
  const std::size_t edge = std::min(bytes, edge_bytes);
  f(std::size_t{0}, edge);
  f(bytes - edge, edge);
  if (bytes >= 4096) {
    for (int k = 1; k <= probes; ++k) f(bytes / (probes + 1) * k, probe_bytes);
  }
}

void write_pattern(void* ptr, std::size_t bytes, std::uint64_t id) noexcept {
  auto* p = static_cast<std::uint8_t*>(ptr);
  const std::uint64_t seed = pattern_seed(id);
  for_each_range(bytes, [&](std::size_t at, std::size_t n) {
    for (std::size_t i = at; i < at + n; ++i) p[i] = pattern_byte(seed, i);
  });
}

bool pattern_intact(const void* ptr, std::size_t bytes, std::uint64_t id) noexcept {
  const auto* p = static_cast<const std::uint8_t*>(ptr);
  const std::uint64_t seed = pattern_seed(id);
  bool ok = true;
  for_each_range(bytes, [&](std::size_t at, std::size_t n) {
    for (std::size_t i = at; i < at + n; ++i) ok &= p[i] == pattern_byte(seed, i);
  });
  return ok;
}

class sim_work final : public stress_work {
 public:
  explicit sim_work(std::shared_ptr<sim_device> sim) : sim_(std::move(sim)) {}
  ~sim_work() override {
    try {
      sim_->synchronize_device();  // no kernel effect may outlive this object
    } catch (...) {
    }
  }

  std::string describe() const override {
    return "host writes of a per-allocation pattern (head, tail, 4 probes), checked before free "
           "and by kernels on record_stream'ed streams";
  }

  void fill(int, void* ptr, std::size_t bytes, std::uint64_t id, stream_ref) override {
    write_pattern(ptr, bytes, id);
  }

  check_result verify(int, void* ptr, std::size_t bytes, std::uint64_t id, stream_ref) override {
    return pattern_intact(ptr, bytes, id) ? check_result::ok : check_result::corrupt;
  }

  void use_on_stream(int, void* ptr, std::size_t bytes, std::uint64_t id,
                     stream_ref other) override {
    // 1-32 us, or 0 behind a busy stream, so that no stream falls ever further behind.
    const std::uint64_t ns = sim_->stream_idle(other) ? (pattern_seed(id) % 32 + 1) * 1000 : 0;
    kernels_.fetch_add(1, std::memory_order_relaxed);
    sim_->launch(other, ns, [this, ptr, bytes, id] {
      async_checks_.fetch_add(1, std::memory_order_relaxed);
      if (!pattern_intact(ptr, bytes, id)) async_corruptions_.fetch_add(1, std::memory_order_relaxed);
    });
  }

  void background(int, stream_ref s, std::uint64_t ns) override {
    if (!sim_->stream_idle(s)) return;
    kernels_.fetch_add(1, std::memory_order_relaxed);
    sim_->launch(s, ns);
  }

  void drain() override { sim_->synchronize_device(); }

  std::uint64_t async_checks() const noexcept override { return async_checks_.load(); }
  std::uint64_t async_corruptions() const noexcept override { return async_corruptions_.load(); }
  std::uint64_t kernels() const noexcept override { return kernels_.load(); }

 private:
  std::shared_ptr<sim_device> sim_;
  std::atomic<std::uint64_t> async_checks_{0};
  std::atomic<std::uint64_t> async_corruptions_{0};
  std::atomic<std::uint64_t> kernels_{0};
};

}  // namespace

std::unique_ptr<stress_work> make_sim_work(std::shared_ptr<sim_device> sim, int) {
  return std::make_unique<sim_work>(std::move(sim));
}

}  // namespace spillway::bench
