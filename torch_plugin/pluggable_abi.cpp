// pluggable_abi.cpp: the extern "C" functions of spillway_alloc.h, for PyTorch's
// CUDAPluggableAllocator and for C callers. Compiled into libspillway_alloc.so and
// libspillway_preload.so.
//
// Every function opens a plugin::entry_scope before calling into spillway (Note [Preload
// re-entrancy] in docs/integration.md) and, except spillway_malloc, catches every exception: the
// callers are C frames, PyTorch deleters and hooks, none of which can take one.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <string>

#include "process_instance.hpp"
#include "spillway/errors.hpp"
#include "spillway_alloc.h"

namespace {

using spillway::plugin::entry_scope;
using spillway::plugin::process_allocator;
using spillway::plugin::report;
using spillway::plugin::set_last_error;
using spillway::format_pointer;

// Runs `body`; an exception becomes the last error and `fallback`.
template <class T, class F>
T guarded(T fallback, F&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    set_last_error(e.what());
  } catch (...) {
    set_last_error("spillway: unknown exception");
  }
  return fallback;
}

// Like guarded, for hooks whose caller cannot see a result: the exception is also written to stderr.
template <class F>
void reported(F&& body) noexcept {
  try {
    body();
  } catch (const std::exception& e) {
    report(e.what());
  } catch (...) {
    report("spillway: unknown exception");
  }
}

std::uint64_t to_u64(std::int64_t v) noexcept { return v < 0 ? 0 : static_cast<std::uint64_t>(v); }

}  // namespace

extern "C" {

void* spillway_malloc(ssize_t size, int device, struct CUstream_st* stream) {
  entry_scope scope;
  try {
    if (size < 0) {
      throw spillway::invalid_argument("spillway_malloc: negative size " + std::to_string(size));
    }
    spillway::plugin_allocator& a = process_allocator();
    return a.allocate(device, static_cast<std::size_t>(size), a.stream_of(stream));
  } catch (const std::exception& e) {
    set_last_error(e.what());
    throw;  // PyTorch turns it into a RuntimeError; see spillway_alloc.h
  }
}

void* spillway_try_malloc(size_t size, int device, struct CUstream_st* stream) {
  entry_scope scope;
  return guarded<void*>(nullptr, [&] {
    spillway::plugin_allocator& a = process_allocator();
    return a.allocate(device, size, a.stream_of(stream));
  });
}

void spillway_free(void* ptr, ssize_t /*size*/, int /*device*/, struct CUstream_st* /*stream*/) {
  if (ptr == nullptr) return;
  entry_scope scope;
  reported([&] {
    if (process_allocator().deallocate(ptr) == spillway::free_result::foreign) {
      // (A double free, free_result::invalid, is reported by the device allocator itself.)
      throw spillway::invalid_argument("spillway: spillway_free(" + format_pointer(ptr) +
                                       "): not allocated by spillway; ignored");
    }
  });
}

void spillway_init(int /*device_count*/) {
  entry_scope scope;
  reported([] { process_allocator(); });
}

void spillway_empty_cache(void) {
  entry_scope scope;
  reported([] { process_allocator().empty_cache(); });
}

void spillway_set_memory_fraction(double fraction, int device) {
  entry_scope scope;
  reported([&] {
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
      throw spillway::invalid_argument("spillway: spillway_set_memory_fraction(" +
                                       std::to_string(fraction) + ", device " + std::to_string(device) +
                                       "): expected a fraction in [0, 1]; the budget is unchanged");
    }
    spillway::device_allocator& d = process_allocator().device(device);
    // As torch's memory fraction: taken below the memory in use too (allocations then fail until
    // frees), and 0 leaves no room for a new segment.
    d.set_budget(spillway::fraction_of_memory(fraction, d.backend().total_memory()),
                 spillway::below_live::accept);
  });
}

void* spillway_base_alloc(void* ptr, size_t* size) {
  entry_scope scope;
  void* base = ptr;  // PyTorch's answer for allocators without the hook: the pointer itself
  reported([&] {
    spillway::device_allocator* d = process_allocator().owner_of(ptr);
    if (d == nullptr) {
      throw spillway::invalid_argument("spillway: spillway_base_alloc(" + format_pointer(ptr) +
                                       "): not a live allocation of spillway; returning the "
                                       "pointer itself");
    }
    const spillway::allocation_info info = d->describe(ptr);
    if (size != nullptr) *size = info.segment_size;
    base = info.segment_base;
  });
  return base;
}

void spillway_record_stream(void* ptr, struct CUstream_st* stream) {
  if (ptr == nullptr) return;  // an empty tensor: nothing to order
  entry_scope scope;
  reported([&] {
    spillway::plugin_allocator& a = process_allocator();
    spillway::device_allocator* d = a.owner_of(ptr);
    if (d == nullptr) {
      throw spillway::invalid_argument("spillway: spillway_record_stream(" + format_pointer(ptr) +
                                       "): not a live allocation of spillway; ignored");
    }
    d->record_stream(ptr, a.stream_of(stream));
  });
}

int spillway_set_budget(int device, size_t bytes) {
  entry_scope scope;
  return guarded<int>(-1, [&] {
    process_allocator().device(device).set_budget(bytes);
    return 0;
  });
}

int spillway_get_stats(int device, spillway_stats* out, size_t size) {
  entry_scope scope;
  return guarded<int>(-1, [&] {
    if (out == nullptr || size < sizeof(std::uint64_t)) {
      throw spillway::invalid_argument("spillway_get_stats: out is NULL or size " + std::to_string(size) +
                                       " is smaller than one field; pass sizeof(spillway_stats)");
    }
    spillway::device_allocator& d = process_allocator().device(device);
    const spillway::memory_stats s = d.stats();
    spillway_stats r{};
    r.budget = d.budget() == spillway::unlimited_budget ? std::numeric_limits<std::uint64_t>::max()
                                                        : static_cast<std::uint64_t>(d.budget());
    r.device_total = d.backend().total_memory();
    r.allocated_bytes = to_u64(s.allocated_bytes[0].current);
    r.peak_allocated_bytes = to_u64(s.allocated_bytes[0].peak);
    r.reserved_bytes = to_u64(s.reserved_bytes[0].current);
    r.peak_reserved_bytes = to_u64(s.reserved_bytes[0].peak);
    r.active_bytes = to_u64(s.active_bytes[0].current);
    r.requested_bytes = to_u64(s.requested_bytes[0].current);
    r.allocations = to_u64(s.allocation[0].current);
    r.segments = to_u64(s.segment[0].current);
    r.num_alloc_retries = to_u64(s.num_alloc_retries);
    r.num_ooms = to_u64(s.num_ooms);
    r.num_invalid_frees = to_u64(s.num_invalid_frees);
    r.num_device_alloc = to_u64(s.num_device_alloc);
    r.num_device_free = to_u64(s.num_device_free);
    std::memcpy(out, &r, std::min(size, sizeof r));
    return 0;
  });
}

int spillway_mem_get_info(int device, size_t* free_bytes, size_t* total_bytes) {
  entry_scope scope;
  return guarded<int>(-1, [&] {
    const spillway::memory_info info = process_allocator().memory_info_of(device);
    if (free_bytes != nullptr) *free_bytes = info.free;
    if (total_bytes != nullptr) *total_bytes = info.total;
    return 0;
  });
}

struct CUstream_st* spillway_stream_create(int device) {
  entry_scope scope;
  return guarded<struct CUstream_st*>(nullptr, [&] {
    const spillway::stream_ref s = process_allocator().device(device).backend().create_stream();
    return reinterpret_cast<struct CUstream_st*>(s.value);
  });
}

int spillway_stream_destroy(int device, struct CUstream_st* stream) {
  entry_scope scope;
  return guarded<int>(-1, [&] {
    process_allocator().device(device).backend().destroy_stream(
        spillway::stream_ref{reinterpret_cast<std::uintptr_t>(stream)});
    return 0;
  });
}

const char* spillway_last_error(void) { return spillway::plugin::last_error().c_str(); }

}  // extern "C"
