// cuda_device: the device_backend of a real CUDA device.
//
// - Segments come from cudaMalloc / cudaFree; out of memory is reported as nullptr and the sticky
//   CUDA error is cleared.
// - VMM (expandable segments) uses the driver API: cuMemAddressReserve, cuMemCreate, cuMemMap,
//   cuMemSetAccess, cuMemUnmap, cuMemRelease, at the allocation granularity (2 MiB on current
//   GPUs). Driver entry points are fetched through cudaGetDriverEntryPoint, so nothing links
//   libcuda directly and the library loads on machines without a driver.
// - Every call runs under a device guard (RAII) for this backend's device.
// - Stream and event handles are cudaStream_t / cudaEvent_t values; stream_ref{} is the legacy
//   default stream.
//
// This header exists only when spillway is built with CUDA (SPILLWAY_WITH_CUDA).
#pragma once

#include <memory>
#include <string>

#include "spillway/device_backend.hpp"

namespace spillway {

// How many CUDA devices this process can use; 0 when there is no driver or no device.
int cuda_device_count() noexcept;

// Why cuda_device_count() is 0, in words ("no CUDA driver", "no CUDA-capable device"), or "".
std::string cuda_unavailable_reason();

// A backend for device `index`. Throws invalid_argument for an index outside
// [0, cuda_device_count()) and device_error if the device cannot be initialised.
std::shared_ptr<device_backend> make_cuda_device(int index);

}  // namespace spillway
