// host_fault_injection: the host running out of memory, on demand. Replaces the global operator
// new and delete of the executable that includes it, so that a test can make the k-th host
// allocation of an operation throw std::bad_alloc (Note [Host out of memory] in docs/design.md).
//
// Contract
// - Include it in exactly one translation unit of a test executable: it *defines* the replaced
//   allocation functions (they may not be inline), and they serve the whole process, the shared
//   libraries it loads (LibTorch's) included.
// - Disarmed (the default) they are malloc and free. A host_fault_scope arms them on the calling
//   thread only: after `after` allocations succeed, the next one throws std::bad_alloc (nothrow
//   forms return nullptr); `persistent` keeps every later one failing too, until the scope ends.
// - t_failures counts the failures injected since the scope was armed; t_countdown may be saved
//   and set to -1 to shield a region (a simulated device standing for the CUDA runtime), then put
//   back. run_with_host_fault runs an operation in such a scope and says what it did.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <exception>
#include <new>

namespace spillway::test {

// < 0: disarmed. Otherwise the number of allocations on this thread that still succeed.
inline thread_local long t_countdown = -1;
inline thread_local bool t_persistent = false;  // keep failing once the countdown ran out
inline thread_local long t_failures = 0;        // failures injected since the last arm

// Arms the failure for the life of the scope, on this thread.
class host_fault_scope {
 public:
  host_fault_scope(long after, bool persistent) noexcept {
    t_failures = 0;
    t_persistent = persistent;
    t_countdown = after;
  }
  ~host_fault_scope() { t_countdown = -1; }
  host_fault_scope(const host_fault_scope&) = delete;
  host_fault_scope& operator=(const host_fault_scope&) = delete;
};

// What an operation run under a host fault did: what it threw (null: it returned), and how many
// failures were injected (0: it made fewer allocations than the countdown allowed).
struct host_fault_run {
  std::exception_ptr error;
  long failures = 0;
};

// Runs `operation` with the host allocation `k` (from 0) failing, and every one after it if
// `persistent`.
template <typename Operation>
host_fault_run run_with_host_fault(long k, bool persistent, Operation&& operation) {
  host_fault_run out;
  host_fault_scope armed(k, persistent);
  try {
    operation();
  } catch (...) {
    out.error = std::current_exception();
  }
  out.failures = t_failures;
  return out;
}

namespace detail {
inline void* allocate_or_throw(std::size_t bytes, std::size_t alignment) {
  if (t_countdown >= 0) {
    if (t_countdown == 0) {
      ++t_failures;
      if (!t_persistent) t_countdown = -1;
      throw std::bad_alloc();
    }
    --t_countdown;
  }
  if (bytes == 0) bytes = 1;
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
inline void* allocate_or_null(std::size_t bytes) noexcept {
  try {
    return allocate_or_throw(bytes, 0);
  } catch (...) {
    return nullptr;
  }
}
}  // namespace detail

}  // namespace spillway::test

void* operator new(std::size_t n) { return spillway::test::detail::allocate_or_throw(n, 0); }
void* operator new[](std::size_t n) { return spillway::test::detail::allocate_or_throw(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return spillway::test::detail::allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return spillway::test::detail::allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return spillway::test::detail::allocate_or_null(n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return spillway::test::detail::allocate_or_null(n);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
