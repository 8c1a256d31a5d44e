// preload_example.cpp: an ordinary CUDA program that knows nothing about spillway
// (docs/integration.md, "LD_PRELOAD"). It asks how much memory there is, then allocates 16 MiB
// blocks until cudaMalloc fails. Build it against the shared CUDA runtime and run it under the shim:
//
//   g++ -std=c++17 preload_example.cpp -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart \
//       -o preload_example                              # or: nvcc -cudart shared ...
//   LD_PRELOAD=/path/to/libspillway_preload.so SPILLWAY_CONF=budget:1GiB ./preload_example
//
// Under the shim it sees a 1 GiB device and stops after 1024 MiB. (ctest builds it and runs it
// under the shim: test example_preload.)
#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

int main() {
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes); err != cudaSuccess) {
    std::printf("cudaMemGetInfo failed: %s\n", cudaGetErrorString(err));
    return 1;
  }
  std::printf("cudaMemGetInfo: %zu MiB free of %zu MiB\n", free_bytes >> 20, total_bytes >> 20);

  const std::size_t chunk = std::size_t{16} << 20;
  std::vector<void*> blocks;
  for (std::size_t tries = 0; tries <= total_bytes / chunk; ++tries) {
    void* p = nullptr;
    if (cudaError_t err = cudaMalloc(&p, chunk); err != cudaSuccess) {
      std::printf("cudaMalloc failed after %zu MiB: %s\n", blocks.size() * (chunk >> 20),
                  cudaGetErrorString(err));
      break;
    }
    blocks.push_back(p);
  }
  for (void* p : blocks) cudaFree(p);
  return blocks.empty() ? 1 : 0;
}
