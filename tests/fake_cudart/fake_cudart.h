/* fake_cudart.h: the test-only extras of tests/fake_cudart (libcudart.so.<major>), a CUDA runtime
 * that runs on host memory so that the preload shim and the C ABI can be tested without a GPU.
 *
 * What it implements (only what spillway's CUDA backend, the shim and the tests call):
 * - one device, 0, with FAKE_CUDART_CAPACITY bytes; cudaMalloc / cudaMallocAsync / cudaMallocManaged
 *   hand out 4 KiB-aligned host memory and fail with cudaErrorMemoryAllocation beyond the capacity
 *   (managed memory is not counted against it);
 * - cudaFree / cudaFreeAsync of a pointer it did not hand out: cudaErrorInvalidValue, counted;
 * - every operation completes at once (copies and memsets are memcpy and memset; events are always
 *   complete; synchronisation returns at once); streams and events are distinct tokens;
 * - no driver entry points: VMM (expandable segments) is unavailable;
 * - the thread's last error, as the real runtime keeps it;
 * - cudaStreamIsCapturing, from marks a test sets (fake_cudart_set_capturing), and
 *   cudaStreamGetDevice (0).
 * The counters say which calls reached the runtime, so tests can tell spillway's work from
 * the runtime's. */
#ifndef SPILLWAY_FAKE_CUDART_H
#define SPILLWAY_FAKE_CUDART_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FAKE_CUDART_CAPACITY ((size_t)256 << 20)

typedef struct fake_cudart_counters {
  uint64_t mallocs;          /* cudaMalloc that succeeded */
  uint64_t frees;            /* cudaFree of a pointer it handed out */
  uint64_t async_mallocs;    /* cudaMallocAsync that succeeded */
  uint64_t async_frees;      /* cudaFreeAsync of a pointer it handed out */
  uint64_t managed_mallocs;  /* cudaMallocManaged that succeeded */
  uint64_t invalid_frees;    /* cudaFree / cudaFreeAsync of anything else (NULL excepted) */
  uint64_t failed_mallocs;   /* device allocations refused for lack of memory */
  uint64_t bytes_in_use;     /* device memory handed out and not freed (managed excluded) */
  uint64_t per_thread_syncs; /* cudaStreamSynchronize(cudaStreamPerThread) */
} fake_cudart_counters;

fake_cudart_counters fake_cudart_get_counters(void);

/* The next cudaDeviceSynchronize fails with `error` (a fault the device reported). */
void fake_cudart_fail_next_device_sync(cudaError_t error);

/* Marks `stream` as being captured into a graph (cudaStreamIsCapturing reports it) or not. The
 * fake runtime records no graph: tests use it to see who would have served what. */
void fake_cudart_set_capturing(cudaStream_t stream, int capturing);

#ifdef __cplusplus
}
#endif

#endif
