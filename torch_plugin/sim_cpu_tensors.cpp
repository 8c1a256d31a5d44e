// sim_cpu_tensors.cpp: the contract is in sim_cpu_tensors.hpp.
#include "sim_cpu_tensors.hpp"

#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#include "spillway/errors.hpp"

namespace spillway::torch_plugin {

namespace {

class sim_cpu_allocator final : public c10::Allocator {
 public:
  explicit sim_cpu_allocator(std::shared_ptr<torch_allocator> owner) : owner_(std::move(owner)) {}

  c10::DataPtr allocate(std::size_t nbytes) override {
    // Out of memory is torch's OutOfMemoryError, with spillway's account of the budget.
    void* ptr = owner_->allocate_on(0, nbytes, stream_ref{});
    return {ptr, ptr, owner_->raw_deleter(), c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return owner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);  // simulated device memory is host memory
  }

 private:
  std::shared_ptr<torch_allocator> owner_;
};

}  // namespace

void serve_cpu_tensors(std::shared_ptr<torch_allocator> allocator) {
  static std::mutex mutex;
  static sim_cpu_allocator* serving = nullptr;  // never destroyed: see the contract
  std::lock_guard lock(mutex);
  if (serving != nullptr) {
    throw invalid_argument("spillway: CPU tensors are already served by spillway's simulated "
                           "device in this process (once per process)");
  }
  if (allocator == nullptr || allocator->config().backend != "sim") {
    throw invalid_argument(std::string("spillway: CPU tensors can be served only by the simulated "
                                       "device (backend sim), not by backend ") +
                           (allocator ? allocator->config().backend : std::string("(none)")));
  }
  serving = new sim_cpu_allocator(std::move(allocator));
  // The highest priority: no later SetCPUAllocator of a lower one replaces it.
  c10::SetCPUAllocator(serving, /*priority=*/UINT8_MAX);
}

}  // namespace spillway::torch_plugin
