// cuda_call.cpp: the device guard and CUDA error messages.
#include "cuda_call.hpp"

#include "spillway/errors.hpp"

namespace spillway::cuda {

std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

void throw_cuda_error(cudaError_t err, const std::string& call, int device) {
  clear_error(err);  // it travels as this exception from now on
  throw device_error(call + " on cuda:" + std::to_string(device) + " failed: " + cuda_error_text(err),
                     static_cast<int>(err));
}

// cudaSetDevice runs even when the device is already current: it also makes the device's primary
// context current on this thread, which the driver-API VMM calls need (they see no runtime state).
// It costs a thread-local lookup when nothing changes.
device_guard::device_guard(int device) {
  int current = -1;
  check_cuda(cudaGetDevice(&current), "cudaGetDevice", device);
  check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
  if (current != device) previous_ = current;
}

device_guard::device_guard(int device, std::nothrow_t) noexcept {
  int current = -1;
  // On failure (e.g. cudaErrorCudartUnloading at exit) go on without a guard.
  if (cudaError_t err = cudaGetDevice(&current); err != cudaSuccess) {
    clear_error(err);
    return;
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    clear_error(err);
    return;
  }
  if (current != device) previous_ = current;
}

device_guard::~device_guard() {
  if (previous_ >= 0) clear_error(cudaSetDevice(previous_));
}

}  // namespace spillway::cuda
