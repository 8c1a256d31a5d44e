// cuda_call: what every CUDA call in the backend goes through.
//
// - device_guard: makes a device current for a scope and restores the previous one (RAII).
//   The throwing form is for calls that must run on the right device; the nothrow form is for
//   release paths, which must not fail and run correctly on any device (cudaFree, cuMemUnmap).
// - throw_cuda_error / check_cuda: turn a cudaError_t into spillway::device_error with the call,
//   its size, the device and the CUDA error: "cudaMalloc(1.00 GiB) on cuda:0 failed:
//   cudaErrorXxx: text". The error is cleared from the thread's last-error slot first, since it
//   now travels as an exception.
// - cuda_error_text: "cudaErrorXxx: text", for messages that are not exceptions.
// - clear_error: drops an error we have handled from the thread's last-error slot.
//
// Only the CUDA backend's sources include this file.
#pragma once

#include <cuda_runtime_api.h>

#include <new>
#include <string>

namespace spillway::cuda {

std::string cuda_error_text(cudaError_t err);

// Clears `err` from the thread's last-error slot (cudaGetLastError) when the slot holds it, so a
// handled error does not resurface from an unrelated later check. Sticky errors stay regardless.
inline void clear_error(cudaError_t err) noexcept {
  if (err != cudaSuccess && cudaPeekAtLastError() == err) (void)cudaGetLastError();
}

[[noreturn]] void throw_cuda_error(cudaError_t err, const std::string& call, int device);

inline void check_cuda(cudaError_t err, const char* call, int device) {
  if (err != cudaSuccess) throw_cuda_error(err, call, device);
}

class device_guard {
 public:
  // Throws device_error if the device cannot be made current.
  explicit device_guard(int device);
  // Best effort; never throws. Used on release paths.
  device_guard(int device, std::nothrow_t) noexcept;
  ~device_guard();

  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = -1;  // -1: nothing to restore
};

}  // namespace spillway::cuda
