// errors: what spillway throws at its API edge.
//
// - out_of_memory: an allocation could not be satisfied within the budget and the device after
//   every step of the pressure path (Note [Memory pressure path] in docs/design.md). It is an
//   expected event: the allocator's state is intact and the caller may free memory and retry.
// - invalid_argument: bad input (size 0, an unknown pointer, an invalid device, ...). The message
//   names the value and what was expected; no allocation was changed.
// - device_error: the device or driver failed in a way that is not lack of memory.
// - logic_error (std): misuse of an object's protocol (for example synchronising on a held
//   simulated stream, or a lineage cycle in the eviction engine).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace spillway {

class out_of_memory : public std::runtime_error {
 public:
  struct details {
    int device = 0;
    std::size_t requested = 0;      // bytes the caller asked for
    std::size_t rounded = 0;        // after rounding to the size table
    std::size_t budget = 0;         // the device budget in force (reserved-bytes cap)
    std::size_t allocated = 0;      // bytes in live allocations
    std::size_t reserved = 0;       // bytes held from the device
    std::size_t largest_free = 0;   // the largest free block in the cache
    std::size_t device_free = 0;    // what the device reported free
    std::size_t pinned = 0;         // bytes that pressure handlers could not evict (0 if none ran)
  };

  out_of_memory(const std::string& what, const details& d) : std::runtime_error(what), details_(d) {}
  const details& info() const noexcept { return details_; }

 private:
  details details_;
};

class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class device_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  // With the backend's own error code (a cudaError_t for CUDA), for callers that pass it on.
  device_error(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  int code() const noexcept { return code_; }  // 0: none

 private:
  int code_ = 0;
};

// "1.50 GiB", "512 B": used in every message that names a size.
std::string format_bytes(std::size_t bytes);
// "0x7f12a4000000" (as printf's %p): used in every message that names an address.
std::string format_pointer(const void* p);

}  // namespace spillway
