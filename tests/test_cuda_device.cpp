// test_cuda_device: the CUDA backend against a real device, and its behaviour without one.
//
// Without a GPU (or driver) this proves: cuda_device_count() is 0 and does not crash,
// cuda_unavailable_reason() says why, make_cuda_device rejects every index with an
// invalid_argument naming it, and CUDA errors read "call on cuda:N failed: name: text".
// Every test that needs a device prints "SKIPPED: no CUDA device: <reason>" and passes.
//
// With a GPU it proves: segments reserve and release; cudaMalloc out of memory is nullptr and
// leaves no error behind; VMM maps, holds data, partially unmaps, rejects misuse, and rolls back a
// map that runs out of memory; events and stream waits order work across streams (a stream is
// held behind a host function so "not yet" is observable); async copies through pinned memory
// round trip bit-identical.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../allocator/src/cuda_call.hpp"  // internal: the error-message helper is tested directly
#include "spillway/cuda_device.hpp"
#include "spillway/errors.hpp"

using namespace spillway;

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

#define SKIP_WITHOUT_CUDA_DEVICE()                                                  \
  do {                                                                              \
    if (cuda_device_count() == 0) {                                                 \
      MESSAGE("SKIPPED: no CUDA device: " << cuda_unavailable_reason());            \
      return;                                                                       \
    }                                                                               \
  } while (0)

std::string invalid_argument_text(int index) {
  try {
    make_cuda_device(index);
  } catch (const spillway::invalid_argument& e) {
    return e.what();
  }
  return "";
}

std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
  std::vector<std::uint8_t> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = static_cast<std::uint8_t>(i * 131 + seed);
  return v;
}

cudaStream_t to_cuda(stream_ref s) { return reinterpret_cast<cudaStream_t>(s.value); }

// Holds a stream behind a host function until open() (or destruction), so work queued after it
// is observably "not done yet". The destructor waits for the stream, so the gate outlives its use.
class stream_gate {
 public:
  explicit stream_gate(stream_ref s) : stream_(to_cuda(s)) {
    REQUIRE(cudaLaunchHostFunc(stream_, &stream_gate::wait, this) == cudaSuccess);
  }
  ~stream_gate() {
    open();
    (void)cudaStreamSynchronize(stream_);
  }
  void open() { open_.store(true); }

 private:
  static void wait(void* self) {
    auto* gate = static_cast<stream_gate*>(self);
    while (!gate->open_.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  cudaStream_t stream_;
  std::atomic<bool> open_{false};
};

std::vector<std::uint8_t> read_device(const void* src, std::size_t bytes) {
  std::vector<std::uint8_t> out(bytes);
  REQUIRE(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

void write_device(void* dst, const std::vector<std::uint8_t>& data) {
  REQUIRE(cudaMemcpy(dst, data.data(), data.size(), cudaMemcpyHostToDevice) == cudaSuccess);
}

char* at(void* base, std::size_t offset) { return static_cast<char*>(base) + offset; }

}  // namespace

// --- what runs everywhere ---------------------------------------------------------------------------

TEST_CASE("cuda_device_count and cuda_unavailable_reason agree, with or without a driver") {
  const int count = cuda_device_count();
  CHECK(count >= 0);
  CHECK(cuda_device_count() == count);  // asking again is as safe as asking once
  if (count == 0) {
    const std::string reason = cuda_unavailable_reason();
    CHECK_FALSE(reason.empty());
    MESSAGE("no CUDA device here: " << reason);
  } else {
    CHECK(cuda_unavailable_reason().empty());
  }
}

TEST_CASE("make_cuda_device rejects an index outside the visible devices and names it") {
  const int count = cuda_device_count();
  for (int index : {-1, count, count + 7}) {
    CAPTURE(index);
    CHECK_THROWS_AS(make_cuda_device(index), spillway::invalid_argument);
    const std::string what = invalid_argument_text(index);
    CHECK(what.find("index " + std::to_string(index)) != std::string::npos);
    CHECK(what.find("sees " + std::to_string(count)) != std::string::npos);
  }
  if (count == 0) CHECK(invalid_argument_text(0).find(cuda_unavailable_reason()) != std::string::npos);
}

TEST_CASE("a CUDA error becomes a device_error naming the call, size, device and error") {
  try {
    cuda::throw_cuda_error(cudaErrorInvalidValue, "cudaMalloc(" + format_bytes(std::size_t{1} << 30) + ")", 0);
    FAIL("throw_cuda_error returned");
  } catch (const device_error& e) {
    const std::string expected = std::string("cudaMalloc(1.00 GiB) on cuda:0 failed: cudaErrorInvalidValue: ") +
                                 cudaGetErrorString(cudaErrorInvalidValue);
    CHECK(std::string(e.what()) == expected);
  }
}

// --- what needs a device ------------------------------------------------------------------------------

TEST_CASE("cuda_device reports its identity and memory") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  CHECK(dev->device_index() == 0);
  CHECK(dev->name().rfind("cuda:0 (", 0) == 0);
  CHECK(dev->name().back() == ')');
  CHECK(dev->total_memory() > 0);
  CHECK(dev->free_memory() <= dev->total_memory());
  MESSAGE(dev->name() << ": " << format_bytes(dev->total_memory()) << " total, "
                      << format_bytes(dev->free_memory()) << " free, VMM granularity "
                      << format_bytes(dev->vmm_granularity()));
}

TEST_CASE("segments reserve and release, and hold data") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  void* seg = dev->reserve_segment(8 * k_mib);
  REQUIRE(seg != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(seg) % 512 == 0);
  const auto data = pattern(8 * k_mib, 3);
  write_device(seg, data);
  CHECK(read_device(seg, data.size()) == data);
  dev->release_segment(seg, 8 * k_mib);
  dev->release_segment(nullptr, 0);  // a no-op
  CHECK_THROWS_AS(dev->reserve_segment(0), spillway::invalid_argument);
}

TEST_CASE("cudaMalloc out of memory is nullptr and leaves no error behind") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  const std::size_t one_pib = std::size_t{1} << 50;
  CHECK(dev->reserve_segment(one_pib) == nullptr);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  void* seg = dev->reserve_segment(k_mib);  // the device still works
  CHECK(seg != nullptr);
  dev->synchronize_device();
  dev->release_segment(seg, k_mib);
}

TEST_CASE("VMM: map, write, read back, partial unmap, remap, release") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  const std::size_t g = dev->vmm_granularity();
  REQUIRE_MESSAGE(g > 0, "VMM unavailable on " << dev->name());
  const std::size_t range = 4 * g;
  void* base = dev->reserve_address_range(range);
  REQUIRE(base != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(base) % g == 0);

  REQUIRE(dev->map_physical(base, range));
  const auto data = pattern(range, 7);
  write_device(base, data);
  CHECK(read_device(base, range) == data);

  // Misuse is rejected before the driver sees it.
  CHECK_THROWS_AS(dev->map_physical(at(base, g), g), spillway::invalid_argument);      // mapped
  CHECK_THROWS_AS(dev->map_physical(at(base, 512), g), spillway::invalid_argument);    // unaligned
  CHECK_THROWS_AS(dev->map_physical(base, g + 512), spillway::invalid_argument);       // odd size

  dev->synchronize_device();
  dev->unmap_physical(at(base, 2 * g), 2 * g);  // the upper half goes; the lower half stays intact
  CHECK(read_device(base, 2 * g) == std::vector<std::uint8_t>(data.begin(), data.begin() + 2 * g));

  REQUIRE(dev->map_physical(at(base, 2 * g), 2 * g));
  const auto upper = pattern(2 * g, 11);
  write_device(at(base, 2 * g), upper);
  CHECK(read_device(at(base, 2 * g), 2 * g) == upper);
  CHECK(cudaPeekAtLastError() == cudaSuccess);

  dev->synchronize_device();
  dev->unmap_physical(base, range);
  dev->unmap_physical(base, range);  // unmapping unmapped pages is a no-op
  dev->release_address_range(base, range);
}

TEST_CASE("VMM: a map that runs out of device memory returns false and leaves nothing mapped") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  const std::size_t g = dev->vmm_granularity();
  REQUIRE_MESSAGE(g > 0, "VMM unavailable on " << dev->name());
  const std::size_t too_much = (dev->total_memory() / g + dev->total_memory() / g / 4 + 1) * g;
  void* base = dev->reserve_address_range(too_much);
  REQUIRE(base != nullptr);

  const std::size_t free_before = dev->free_memory();
  CHECK_FALSE(dev->map_physical(base, too_much));
  const std::size_t free_after = dev->free_memory();
  CHECK(free_after + 256 * k_mib >= free_before);  // every page this call made is released again

  REQUIRE(dev->map_physical(base, g));  // and the range is usable afterwards
  dev->unmap_physical(base, g);
  dev->release_address_range(base, too_much);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("events and stream waits order work across streams") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  const std::size_t bytes = 4 * k_mib;
  stream_ref producer = dev->create_stream();
  stream_ref consumer = dev->create_stream();
  CHECK(producer != stream_ref{});
  CHECK(producer != consumer);
  event_ref produced = dev->create_event();
  event_ref consumed = dev->create_event();
  CHECK(dev->event_completed(produced));  // never recorded: nothing to wait for

  void* seg = dev->reserve_segment(bytes);
  auto* src = static_cast<std::uint8_t*>(dev->allocate_pinned_host(bytes));
  auto* dst = static_cast<std::uint8_t*>(dev->allocate_pinned_host(bytes));
  REQUIRE(seg != nullptr);
  REQUIRE(src != nullptr);
  REQUIRE(dst != nullptr);
  const auto data = pattern(bytes, 5);
  std::memcpy(src, data.data(), bytes);
  std::memset(dst, 0, bytes);
  {
    stream_gate gate(producer);
    dev->copy_async(seg, src, bytes, copy_kind::host_to_device, producer);
    dev->record_event(produced, producer);
    dev->stream_wait_event(consumer, produced);
    dev->copy_async(dst, seg, bytes, copy_kind::device_to_host, consumer);
    dev->record_event(consumed, consumer);

    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK_FALSE(dev->event_completed(produced));
    CHECK_FALSE(dev->event_completed(consumed));  // the consumer waits on the held producer
    CHECK(cudaPeekAtLastError() == cudaSuccess);  // "not ready" left nothing behind
    gate.open();
    dev->synchronize_event(consumed);
  }
  CHECK(dev->event_completed(produced));
  CHECK(dev->event_completed(consumed));
  CHECK(std::memcmp(dst, data.data(), bytes) == 0);

  dev->free_pinned_host(dst, bytes);
  dev->free_pinned_host(src, bytes);
  dev->release_segment(seg, bytes);
  dev->destroy_event(consumed);
  dev->destroy_event(produced);
  dev->destroy_stream(consumer);
  dev->destroy_stream(producer);
  dev->destroy_stream(stream_ref{});  // the default stream is not destroyed
}

TEST_CASE("async copies round trip through pinned memory, on a stream and the default stream") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  const std::size_t bytes = 64 * k_mib;
  auto* host_in = static_cast<std::uint8_t*>(dev->allocate_pinned_host(bytes));
  auto* host_out = static_cast<std::uint8_t*>(dev->allocate_pinned_host(bytes));
  void* a = dev->reserve_segment(bytes);
  void* b = dev->reserve_segment(bytes);
  REQUIRE(host_in != nullptr);
  REQUIRE(host_out != nullptr);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  const auto data = pattern(bytes, 9);
  std::memcpy(host_in, data.data(), bytes);

  for (bool default_stream : {false, true}) {
    CAPTURE(default_stream);
    stream_ref s = default_stream ? stream_ref{} : dev->create_stream();
    std::memset(host_out, 0, bytes);
    dev->copy_async(a, host_in, bytes, copy_kind::host_to_device, s);
    dev->copy_async(b, a, bytes, copy_kind::device_to_device, s);
    dev->copy_async(host_out, b, bytes, copy_kind::device_to_host, s);
    dev->copy_async(host_out, host_in, 0, copy_kind::host_to_host, s);  // zero bytes: nothing
    dev->synchronize_stream(s);
    CHECK(std::memcmp(host_out, data.data(), bytes) == 0);
    dev->destroy_stream(s);
  }

  dev->release_segment(b, bytes);
  dev->release_segment(a, bytes);
  dev->free_pinned_host(host_out, bytes);
  dev->free_pinned_host(host_in, bytes);
}

TEST_CASE("pinned host memory out of memory is nullptr") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto dev = make_cuda_device(0);
  CHECK(dev->allocate_pinned_host(std::size_t{1} << 50) == nullptr);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  void* p = dev->allocate_pinned_host(k_mib);
  CHECK(p != nullptr);
  dev->free_pinned_host(p, k_mib);
  CHECK_THROWS_AS(dev->allocate_pinned_host(0), spillway::invalid_argument);
}
