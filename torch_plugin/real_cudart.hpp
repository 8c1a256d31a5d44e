// real_cudart: the CUDA runtime functions the preload shim interposes, as the next object in the
// process's lookup order defines them (dlsym(RTLD_NEXT, ...)): the program's libcudart.so.
//
// - real() resolves them once, on first use (thread-safe), from the object that calls it, which
//   must be libspillway_preload.so itself (RTLD_NEXT is relative to the caller).
// - A function the runtime does not have (cudaMallocAsync before CUDA 11.2) is nullptr; callers
//   answer cudaErrorNotSupported for it.
#pragma once

#include <cuda_runtime_api.h>

namespace spillway::preload {

struct real_cudart {
  cudaError_t (*malloc)(void**, size_t) = nullptr;
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*malloc_async)(void**, size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*malloc_async_ptsz)(void**, size_t, cudaStream_t) = nullptr;  // per-thread default stream
  cudaError_t (*free_async_ptsz)(void*, cudaStream_t) = nullptr;
  cudaError_t (*mem_get_info)(size_t*, size_t*) = nullptr;
};

const real_cudart& real();

}  // namespace spillway::preload
