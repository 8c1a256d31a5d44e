// stress_cuda_work.cpp: stress_work on a CUDA device (built only with SPILLWAY_WITH_CUDA).
// See stress_work.hpp.
//
// fill: cudaMemsetAsync of the allocation's pattern byte on its stream (all of it up to 4 MiB,
// else the first and last MiB). verify: for one allocation in sixteen, the first and last 4 KiB
// are copied back to pinned memory on the allocation's stream and compared. use_on_stream: a
// memset of the same byte over the first 64 KiB on the other stream; if the allocator reused the
// block before that stream was done, it overwrites the next owner's bytes and a sampled verify of
// that owner sees it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "spillway/errors.hpp"
#include "stress_work.hpp"

namespace spillway::bench {
namespace {

constexpr std::size_t full_fill_limit = std::size_t{4} << 20;
constexpr std::size_t edge_fill = std::size_t{1} << 20;
constexpr std::size_t check_bytes = 4096;  // head and tail copied back
constexpr std::size_t use_bytes = std::size_t{64} << 10;
constexpr std::size_t scratch_bytes = std::size_t{1} << 20;

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw device_error(std::string("spillway-stress: ") + what + " failed: " +
                       cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")");
  }
}

cudaStream_t to_cuda(stream_ref s) noexcept {
  return s.value == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(s.value);
}

std::uint8_t fill_byte(std::uint64_t id) noexcept {
  return static_cast<std::uint8_t>(pattern_seed(id));  // odd: never the zero of fresh memory
}

class cuda_work final : public stress_work {
 public:
  cuda_work(int device, int threads) : device_(device), pinned_(static_cast<std::size_t>(threads)) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    for (auto& p : pinned_) {
      check(cudaMallocHost(&p.buffer, 2 * check_bytes), "cudaMallocHost");
    }
    check(cudaMalloc(&scratch_, scratch_bytes), "cudaMalloc(scratch)");
  }
  ~cuda_work() override {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    for (auto& p : pinned_) cudaFreeHost(p.buffer);
    cudaFree(scratch_);
  }

  std::string describe() const override {
    return "cudaMemsetAsync of a per-allocation byte on its stream, 1 in 16 checked by copying "
           "back head and tail before free; 64 KiB memsets on record_stream'ed streams";
  }

  void fill(int, void* ptr, std::size_t bytes, std::uint64_t id, stream_ref stream) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    const int value = fill_byte(id);
    if (bytes <= full_fill_limit) {
      check(cudaMemsetAsync(ptr, value, bytes, to_cuda(stream)), "cudaMemsetAsync");
    } else {
      auto* p = static_cast<std::uint8_t*>(ptr);
      check(cudaMemsetAsync(p, value, edge_fill, to_cuda(stream)), "cudaMemsetAsync");
      check(cudaMemsetAsync(p + bytes - edge_fill, value, edge_fill, to_cuda(stream)),
            "cudaMemsetAsync");
    }
  }

  check_result verify(int thread, void* ptr, std::size_t bytes, std::uint64_t id,
                      stream_ref stream) override {
    if ((pattern_seed(id) >> 8) % 16 != 0) return check_result::skipped;
    check(cudaSetDevice(device_), "cudaSetDevice");
    auto* host = static_cast<std::uint8_t*>(pinned_[static_cast<std::size_t>(thread)].buffer);
    const auto* p = static_cast<const std::uint8_t*>(ptr);
    const std::size_t n = std::min(bytes, check_bytes);
    const cudaStream_t s = to_cuda(stream);
    check(cudaMemcpyAsync(host, p, n, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    check(cudaMemcpyAsync(host + n, p + bytes - n, n, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    const std::uint8_t value = fill_byte(id);
    for (std::size_t i = 0; i < 2 * n; ++i) {
      if (host[i] != value) return check_result::corrupt;
    }
    return check_result::ok;
  }

  void use_on_stream(int, void* ptr, std::size_t bytes, std::uint64_t id,
                     stream_ref other) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    kernels_.fetch_add(1, std::memory_order_relaxed);
    check(cudaMemsetAsync(ptr, fill_byte(id), std::min(bytes, use_bytes), to_cuda(other)),
          "cudaMemsetAsync");
  }

  void background(int, stream_ref s, std::uint64_t ns) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    kernels_.fetch_add(1, std::memory_order_relaxed);
    // About `ns` of device time at a few hundred GB/s; capped by the scratch buffer.
    const std::size_t bytes = std::min<std::size_t>(scratch_bytes, ns * 256);
    check(cudaMemsetAsync(scratch_, 0, bytes, to_cuda(s)), "cudaMemsetAsync(scratch)");
  }

  void drain() override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  // CUDA checks are synchronous (verify); stream work only writes.
  std::uint64_t async_checks() const noexcept override { return 0; }
  std::uint64_t async_corruptions() const noexcept override { return 0; }
  std::uint64_t kernels() const noexcept override { return kernels_.load(); }

 private:
  struct alignas(64) pinned_slot {
    void* buffer = nullptr;
  };
  int device_;
  std::vector<pinned_slot> pinned_;
  void* scratch_ = nullptr;
  std::atomic<std::uint64_t> kernels_{0};
};

}  // namespace

std::unique_ptr<stress_work> make_cuda_work(int device, int threads) {
  return std::make_unique<cuda_work>(device, threads);
}

}  // namespace spillway::bench
