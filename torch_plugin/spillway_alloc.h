/* spillway_alloc.h: the C ABI of libspillway_alloc.so (and of libspillway_preload.so, which
 * exports the same functions next to its CUDA interposers). docs/integration.md is the guide.
 *
 * One process-wide allocator serves every call. It is built on first use from the environment
 * variable SPILLWAY_CONF ("budget:8GiB,backend:cuda,..."; torch_plugin/config_string.hpp lists
 * the keys); backend "cuda" by default, "sim" for the simulated device (no GPU needed). Devices are
 * set up on first use. Every function is thread-safe.
 *
 * Errors: spillway_last_error() returns the message of the most recent failure on the calling
 * thread ("" if none); successful calls leave it alone, like errno. Problems that cannot be
 * returned (a free of a pointer spillway does not own, a refused budget in a PyTorch hook) are
 * also written to stderr. Only spillway_malloc throws, and only C++ callers may call it.
 *
 * Streams are CUDA streams (cudaStream_t, i.e. struct CUstream_st*); NULL is the default stream.
 * With backend "sim", pass NULL or a stream from spillway_stream_create.
 */
#ifndef SPILLWAY_ALLOC_H
#define SPILLWAY_ALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cudaStream_t is struct CUstream_st* */

/* --- PyTorch: torch.cuda.memory.CUDAPluggableAllocator(path, "spillway_malloc", "spillway_free")
 * The signatures are the ones torch/csrc/cuda/CUDAPluggableAllocator.h calls. */

/* size bytes on `device`, usable in stream order on `stream`. size 0 returns NULL.
 * On failure (out of memory within the budget, a bad device, an invalid SPILLWAY_CONF) it records
 * the message and THROWS a C++ exception derived from std::exception (spillway::out_of_memory,
 * spillway::invalid_argument, spillway::device_error), which PyTorch turns into a RuntimeError
 * carrying the message. PyTorch does not check the pointer its allocator returns, so NULL is not
 * an option there. C callers use spillway_try_malloc. */
void* spillway_malloc(ssize_t size, int device, struct CUstream_st* stream);

/* Frees ptr in stream order (size, device and stream are PyTorch's bookkeeping and are not
 * needed). NULL is a no-op; a pointer spillway does not own is reported and ignored. Never throws. */
void spillway_free(void* ptr, ssize_t size, int device, struct CUstream_st* stream);

/* Optional hooks, installed on the object that CUDAPluggableAllocator.allocator() returns with
 * set_init_fn, set_reset_fn, set_memory_fraction_fn, set_base_alloc_fn, set_record_stream_fn.
 * None of them throws; failures are reported (stderr and spillway_last_error). */
void spillway_init(int device_count);                       /* builds the allocator now */
void spillway_empty_cache(void);                            /* torch.cuda.empty_cache() */
void spillway_set_memory_fraction(double fraction, int device); /* budget = fraction * memory, fraction in [0, 1]; as torch, taken below live memory (allocations then fail until frees) */
void* spillway_base_alloc(void* ptr, size_t* size);         /* segment base and size */
void spillway_record_stream(void* ptr, struct CUstream_st* stream); /* tensor.record_stream */

/* --- C API ----------------------------------------------------------------------------------- */

/* Like spillway_malloc, but returns NULL on failure (and for size 0) instead of throwing. */
void* spillway_try_malloc(size_t size, int device, struct CUstream_st* stream);

/* Sets the budget (cap on reserved bytes) of `device`. Returns 0, or -1 when it is refused (below
 * the bytes in live allocations) or fails; the old budget then stays. */
int spillway_set_budget(int device, size_t bytes);

typedef struct spillway_stats {
  uint64_t budget;               /* cap on reserved bytes; UINT64_MAX: none */
  uint64_t device_total;         /* memory of the device */
  uint64_t allocated_bytes;      /* live allocations (rounded sizes) */
  uint64_t peak_allocated_bytes;
  uint64_t reserved_bytes;       /* held from the device */
  uint64_t peak_reserved_bytes;
  uint64_t active_bytes;         /* allocated, plus freed blocks waiting on other streams */
  uint64_t requested_bytes;      /* what callers asked for, before rounding */
  uint64_t allocations;          /* live allocations */
  uint64_t segments;             /* segments held */
  uint64_t num_alloc_retries;    /* allocations that needed the memory pressure path */
  uint64_t num_ooms;             /* out-of-memory failures */
  uint64_t num_invalid_frees;    /* frees of pointers that were not live allocations */
  uint64_t num_device_alloc;     /* segments reserved / pages mapped */
  uint64_t num_device_free;      /* segments released / pages unmapped */
} spillway_stats;

/* Fills the first `size` bytes of *out (pass sizeof(spillway_stats)) for `device`. Returns 0, or -1
 * for a bad device, a NULL out or a size smaller than one field. */
int spillway_get_stats(int device, spillway_stats* out, size_t size);

/* What cudaMemGetInfo reports under spillway (the preload shim returns exactly this): total =
 * min(budget, device memory); free = what new allocations can still get. Returns 0 or -1. */
int spillway_mem_get_info(int device, size_t* free_bytes, size_t* total_bytes);

/* Streams of the backend's device: a CUDA stream (non-blocking) for "cuda", a simulated one for
 * "sim". spillway_stream_create returns NULL on failure. */
struct CUstream_st* spillway_stream_create(int device);
int spillway_stream_destroy(int device, struct CUstream_st* stream);

/* The message of the most recent failure on this thread, "" if none. Valid until the next spillway
 * call on this thread. */
const char* spillway_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SPILLWAY_ALLOC_H */
