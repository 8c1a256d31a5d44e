// alloc_peers: the allocators spillway-alloc-bench compares spillway with on a GPU, on the same
// cases (alloc_bench_cases.hpp). Built only with SPILLWAY_WITH_CUDA; run only with --device cuda.
//
//   cudaMalloc        cudaMalloc / cudaFree                   cache_hit, multi_thread
//   cudaMallocAsync   cudaMallocAsync / cudaFreeAsync on the  cache_hit, split, cross_stream,
//                     stream; the device's default pool with   multi_thread
//                     its release threshold at UINT64_MAX, so
//                     it caches
//   cub               cub::CachingDeviceAllocator (defaults)   cache_hit, cross_stream, multi_thread
//                     (bins never split: no split case)
// A cross-stream free for the peers is cudaEventRecord on s2, cudaStreamWaitEvent on s1, then the
// free on s1: what a caller must do to free memory another stream used.
#pragma once

#include <vector>

#include "alloc_bench_cases.hpp"

namespace spillway::bench {

#ifdef SPILLWAY_WITH_CUDA
// Streams s1, s2 and per_thread belong to CUDA device `device`.
std::vector<case_result> run_cuda_peers(int device, stream_ref s1, stream_ref s2,
                                        const std::vector<stream_ref>& per_thread,
                                        const timing& t);
#endif

}  // namespace spillway::bench
