// test_torch_install: torch_plugin::install makes a torch_allocator every CUDA allocator torch
// looks up: CUDACachingAllocator's (torch.cuda.*), and c10::GetAllocator(kCUDA), which
// at::getDeviceAllocator serves torch.accelerator's statistics, empty_cache and memory info from.
// Its own executable: an allocator is installed once per process, for good.
#include "torch_doctest.hpp"  // ATen and doctest
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include "torch_allocator_fixture.hpp"

using namespace spillway::test;

TEST_CASE("an installed allocator is torch's CUDA allocator for torch.cuda and torch.accelerator") {
  std::shared_ptr<spillway::torch_plugin::torch_allocator> allocator = make("budget:64MiB");
  spillway::torch_plugin::torch_allocator* const a = allocator.get();
  spillway::torch_plugin::install(std::move(allocator));
  CHECK(spillway::torch_plugin::installed() == a);
  CHECK(cca::get() == a);
  CHECK(c10::GetAllocator(c10::kCUDA) == a);
  REQUIRE(at::getDeviceAllocator(c10::kCUDA) == a);

  // A storage allocated through c10's lookup is spillway's, and torch.accelerator sees it.
  c10::DataPtr p = c10::GetAllocator(c10::kCUDA)->allocate(3 * MiB);
  REQUIRE(p.get() != nullptr);
  CHECK(allocated_now(*a) == static_cast<std::int64_t>(3 * MiB));
  const c10::CachingDeviceAllocator::DeviceStats stats =
      at::getDeviceAllocator(c10::kCUDA)->getDeviceStats(0);
  CHECK(stats.allocated_bytes[0].current == static_cast<std::int64_t>(3 * MiB));
  p.clear();
  CHECK(allocated_now(*a) == 0);
  at::getDeviceAllocator(c10::kCUDA)->emptyCache();
  CHECK(a->getDeviceStats(0).reserved_bytes[0].current == 0);
  const auto [free, total] = at::getDeviceAllocator(c10::kCUDA)->getMemoryInfo(0);
  CHECK(total == 64 * MiB);  // getMemoryInfo under spillway: total is the budget
  CHECK(free <= total);
}
