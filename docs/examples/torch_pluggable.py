"""torch_pluggable.py: spillway as PyTorch's CUDA allocator (docs/integration.md).

    SPILLWAY_CONF=budget:8GiB python torch_pluggable.py /path/to/libspillway_alloc.so

It must run before anything allocates CUDA memory: PyTorch refuses to swap an allocator that has
been used. (ctest only checks that this file compiles; running it needs PyTorch and a GPU.)
"""
import ctypes
import sys

import torch

LIBRARY = sys.argv[1] if len(sys.argv) > 1 else "libspillway_alloc.so"

# The allocator: torch calls spillway_malloc(size, device, stream) and
# spillway_free(ptr, size, device, stream).
allocator = torch.cuda.memory.CUDAPluggableAllocator(LIBRARY, "spillway_malloc", "spillway_free")

# The optional hooks, by address (the same library: ctypes returns the handle already loaded).
lib = ctypes.CDLL(LIBRARY)


def address(name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


hooks = allocator.allocator()  # torch._C._CUDAPluggableAllocator
hooks.set_record_stream_fn(address("spillway_record_stream"))  # tensor.record_stream(s)
hooks.set_reset_fn(address("spillway_empty_cache"))  # torch.cuda.empty_cache()
hooks.set_memory_fraction_fn(address("spillway_set_memory_fraction"))  # set_per_process_memory_fraction
hooks.set_base_alloc_fn(address("spillway_base_alloc"))  # CUDA IPC of tensors
hooks.set_init_fn(address("spillway_init"))

torch.cuda.memory.change_current_allocator(allocator)

x = torch.empty(1 << 20, device="cuda")  # served by spillway


# torch.cuda.memory_stats() does not work with pluggable allocators: ask spillway.
class SpillwayStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "budget", "device_total", "allocated_bytes", "peak_allocated_bytes", "reserved_bytes",
        "peak_reserved_bytes", "active_bytes", "requested_bytes", "allocations", "segments",
        "num_alloc_retries", "num_ooms", "num_invalid_frees", "num_device_alloc", "num_device_free")]


stats = SpillwayStats()
lib.spillway_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(SpillwayStats), ctypes.c_size_t]
lib.spillway_last_error.restype = ctypes.c_char_p
if lib.spillway_get_stats(0, ctypes.byref(stats), ctypes.sizeof(stats)) != 0:
    raise RuntimeError(lib.spillway_last_error().decode())
print(f"allocated {stats.allocated_bytes} B, reserved {stats.reserved_bytes} B, budget {stats.budget} B")

# Past the budget, PyTorch raises RuntimeError carrying spillway's out-of-memory message.
try:
    torch.empty(stats.budget, dtype=torch.uint8, device="cuda")
except RuntimeError as e:
    print("refused:", e)
