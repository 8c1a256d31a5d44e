// real_cudart.cpp: dlsym(RTLD_NEXT) for the interposed CUDA runtime functions.
#include "real_cudart.hpp"

#include <dlfcn.h>

namespace spillway::preload {
namespace {

template <class Fn>
void resolve(Fn& out, const char* name) noexcept {
  out = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

real_cudart resolve_all() noexcept {
  real_cudart r;
  resolve(r.malloc, "cudaMalloc");
  resolve(r.free, "cudaFree");
  resolve(r.malloc_async, "cudaMallocAsync");
  resolve(r.free_async, "cudaFreeAsync");
  resolve(r.malloc_async_ptsz, "cudaMallocAsync_ptsz");
  resolve(r.free_async_ptsz, "cudaFreeAsync_ptsz");
  resolve(r.mem_get_info, "cudaMemGetInfo");
  return r;
}

}  // namespace

const real_cudart& real() {
  static const real_cudart table = resolve_all();
  return table;
}

}  // namespace spillway::preload
