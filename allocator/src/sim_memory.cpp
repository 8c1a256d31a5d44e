// sim_memory.cpp: segments, VMM ranges and pinned memory of the simulated device, all from mmap.
#include "sim_memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <utility>

#include "spillway/errors.hpp"

namespace spillway::detail {
namespace {

constexpr int k_anonymous = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

void* map_anonymous(std::size_t bytes, int protection) noexcept {
  void* p = ::mmap(nullptr, bytes, protection, k_anonymous, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

constexpr std::size_t k_arena_alignment = std::size_t{2} << 20;
constexpr std::size_t k_arena_limit = std::size_t{1} << 40;
constexpr std::size_t k_segment_alignment = 4096;  // mprotect granularity; cudaMalloc promises 512

std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

std::string range_text(const void* addr, std::size_t bytes) {
  return format_pointer(addr) + ", " + format_bytes(bytes);
}

}  // namespace

sim_memory::sim_memory(const sim_config& config, sim_counters& counters, std::string name)
    : config_(config), counters_(counters), name_(std::move(name)) {}

sim_memory::~sim_memory() {
  for (auto& [ptr, bytes] : segments_)
    if (!in_arena(ptr)) ::munmap(ptr, bytes);  // the arena's go with it
  if (arena_base_ != 0) ::munmap(reinterpret_cast<void*>(arena_base_), arena_bytes_);
  for (auto& [base, range] : ranges_) ::munmap(reinterpret_cast<void*>(base), range.bytes);
  for (auto& [ptr, bytes] : pinned_) ::munmap(ptr, bytes);
}

// --- plain segments --------------------------------------------------------------------------------

void* sim_memory::reserve_segment(std::size_t bytes) noexcept {
  if (bytes > config_.capacity - counters_.used_bytes) return nullptr;
  void* ptr = carve_from_arena(bytes);
  if (ptr == nullptr) ptr = map_anonymous(bytes, PROT_READ | PROT_WRITE);
  if (ptr == nullptr) return nullptr;
  try {
    segments_.emplace(ptr, bytes);
  } catch (...) {  // bad_alloc in the bookkeeping: report it as what it is, no memory
    if (!return_to_arena(ptr, bytes)) ::munmap(ptr, bytes);
    return nullptr;
  }
  count_device(bytes);
  ++counters_.segments_reserved;
  return ptr;
}

bool sim_memory::release_segment(void* ptr) noexcept {
  auto it = segments_.find(ptr);
  if (it == segments_.end()) {
    ++counters_.invalid_releases;  // cudaFree would fail: counted for tests
    return false;
  }
  // The size we mapped, whatever the caller passes.
  if (!return_to_arena(ptr, it->second)) ::munmap(ptr, it->second);
  uncount_device(it->second);
  ++counters_.segments_released;
  segments_.erase(it);
  return true;
}

// The lowest free range of the arena that holds `bytes`, made read/write (fresh zero pages).
void* sim_memory::carve_from_arena(std::size_t bytes) noexcept {
  if (!arena_tried_) {  // reserve on first use: a device that never reserves a segment costs nothing
    arena_tried_ = true;
    const std::size_t capacity = std::min(config_.capacity, k_arena_limit / 2);
    const std::size_t want = round_up(std::max<std::size_t>(2 * capacity, k_arena_alignment),
                                      k_arena_alignment);
    if (void* raw = map_anonymous(want + k_arena_alignment, PROT_NONE); raw != nullptr) {
      const auto start = reinterpret_cast<std::uintptr_t>(raw);
      arena_base_ = round_up(start, k_arena_alignment);
      if (arena_base_ > start) ::munmap(raw, arena_base_ - start);
      if (const std::size_t tail = start + want + k_arena_alignment - (arena_base_ + want); tail > 0)
        ::munmap(reinterpret_cast<void*>(arena_base_ + want), tail);
      arena_bytes_ = want;
      try {
        arena_free_.emplace(0, want);
      } catch (...) {
        ::munmap(reinterpret_cast<void*>(arena_base_), want);
        arena_base_ = 0;
        arena_bytes_ = 0;
      }
    }
  }
  if (bytes == 0 || bytes > arena_bytes_) return nullptr;
  const std::size_t need = round_up(bytes, k_segment_alignment);
  for (auto it = arena_free_.begin(); it != arena_free_.end(); ++it) {
    const auto [offset, size] = *it;
    if (size < need) continue;
    void* ptr = reinterpret_cast<void*>(arena_base_ + offset);
    if (::mmap(ptr, need, PROT_READ | PROT_WRITE, k_anonymous | MAP_FIXED, -1, 0) == MAP_FAILED)
      return nullptr;
    arena_free_.erase(it);
    if (size > need) {
      try {
        arena_free_.emplace(offset + need, size - need);
      } catch (...) {  // the remainder is lost to the arena, not to correctness
      }
    }
    return ptr;
  }
  return nullptr;
}

// Maps PROT_NONE over a carved segment (its pages go back) and merges its range with free
// neighbours. False when `ptr` is not inside the arena.
bool sim_memory::in_arena(const void* ptr) const noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  return arena_base_ != 0 && a >= arena_base_ && a - arena_base_ < arena_bytes_;
}

bool sim_memory::return_to_arena(void* ptr, std::size_t bytes) noexcept {
  if (!in_arena(ptr)) return false;
  std::size_t offset = reinterpret_cast<std::uintptr_t>(ptr) - arena_base_;
  std::size_t size = round_up(bytes, k_segment_alignment);
  ::mmap(ptr, size, PROT_NONE, k_anonymous | MAP_FIXED, -1, 0);
  try {
    auto next = arena_free_.lower_bound(offset);
    if (next != arena_free_.end() && next->first == offset + size) {
      size += next->second;
      next = arena_free_.erase(next);
    }
    if (next != arena_free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += size;
        return true;
      }
    }
    arena_free_.emplace_hint(next, offset, size);
  } catch (...) {  // the range is lost to the arena, not to correctness
  }
  return true;
}

// --- virtual memory --------------------------------------------------------------------------------

void* sim_memory::reserve_address_range(std::size_t bytes) {
  const std::size_t g = config_.vmm_granularity;
  if (g == 0)
    throw invalid_argument("reserve_address_range(" + format_bytes(bytes) + ") on " + name_ +
                           ": VMM is disabled (vmm_granularity 0); check vmm_granularity() first");
  if (bytes == 0 || bytes % g != 0)
    throw invalid_argument("reserve_address_range(" + format_bytes(bytes) + ") on " + name_ +
                           ": size " + std::to_string(bytes) +
                           " must be a non-zero multiple of the granularity " + format_bytes(g));
  if (bytes > SIZE_MAX - g) return nullptr;
  // Over-reserve by one granule and trim both ends: mmap only promises page alignment.
  void* raw = map_anonymous(bytes + g, PROT_NONE);
  if (raw == nullptr) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t base = (start + g - 1) / g * g;
  if (base > start) ::munmap(raw, base - start);
  if (const std::size_t tail = start + bytes + g - (base + bytes); tail > 0)
    ::munmap(reinterpret_cast<void*>(base + bytes), tail);
  try {
    ranges_.emplace(base, address_range{bytes, std::vector<bool>(bytes / g, false)});
  } catch (...) {
    ::munmap(reinterpret_cast<void*>(base), bytes);
    throw;
  }
  return reinterpret_cast<void*>(base);
}

bool sim_memory::release_address_range(void* base) noexcept {
  auto it = ranges_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == ranges_.end()) {
    ++counters_.invalid_releases;
    return false;
  }
  address_range& range = it->second;
  unmap_pages(it->first, range, 0, range.mapped.size());  // CUDA wants this done first; we forgive
  ::munmap(base, range.bytes);
  ranges_.erase(it);
  return true;
}

void sim_memory::check_map(const void* addr, std::size_t bytes) const {
  const std::size_t g = config_.vmm_granularity;
  if (g == 0) throw_bad_map(addr, bytes, "VMM is disabled (vmm_granularity 0)");
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  if (bytes == 0 || bytes % g != 0 || a % g != 0)
    throw_bad_map(addr, bytes,
                  "address and size must be non-zero multiples of the granularity " + format_bytes(g));
  std::uintptr_t base = 0;
  const address_range* range = find_range(a, bytes, &base);
  if (range == nullptr) throw_bad_map(addr, bytes, "not inside one reserved address range");
  for (std::size_t page = (a - base) / g, last = page + bytes / g; page < last; ++page)
    if (range->mapped[page])
      throw_bad_map(addr, bytes,
                    "page " + format_pointer(reinterpret_cast<const void*>(base + page * g)) +
                        " is already mapped");
}

bool sim_memory::map(void* addr, std::size_t bytes) noexcept {
  if (bytes > config_.capacity - counters_.used_bytes) return false;
  std::uintptr_t base = 0;
  address_range* range = find_range(reinterpret_cast<std::uintptr_t>(addr), bytes, &base);
  if (range == nullptr) return false;  // check_map() rules this out
  // mprotect can fail with ENOMEM when splitting the mapping exceeds vm.max_map_count.
  if (::mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0) return false;
  const std::size_t g = config_.vmm_granularity;
  const std::size_t first = (reinterpret_cast<std::uintptr_t>(addr) - base) / g;
  std::fill_n(range->mapped.begin() + static_cast<std::ptrdiff_t>(first), bytes / g, true);
  count_device(bytes);
  counters_.pages_mapped += bytes / g;
  return true;
}

std::size_t sim_memory::unmap(void* addr, std::size_t bytes) noexcept {
  const std::size_t g = config_.vmm_granularity;
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  if (g == 0 || bytes == 0) return 0;
  if (a % g != 0 || bytes % g != 0) {
    ++counters_.misaligned_unmaps;  // cuMemUnmap refuses it and changes nothing: counted for tests
    return 0;
  }
  std::uintptr_t base = 0;
  address_range* range = find_range(a, bytes, &base);
  if (range == nullptr) return 0;
  const std::size_t first = (a - base) / g;
  const std::uint64_t before = counters_.pages_unmapped;
  unmap_pages(base, *range, first, first + bytes / g);
  return static_cast<std::size_t>(counters_.pages_unmapped - before);
}

// Unmaps the mapped pages in [first, last), one system call per run of mapped pages.
void sim_memory::unmap_pages(std::uintptr_t base, address_range& range, std::size_t first,
                             std::size_t last) noexcept {
  const std::size_t g = config_.vmm_granularity;
  std::size_t page = first;
  while (page < last) {
    if (!range.mapped[page]) {
      ++page;
      continue;
    }
    std::size_t end = page;
    while (end < last && range.mapped[end]) range.mapped[end++] = false;
    void* run = reinterpret_cast<void*>(base + page * g);
    const std::size_t run_bytes = (end - page) * g;
    ::madvise(run, run_bytes, MADV_DONTNEED);  // a later map reads zeros, and the memory goes back
    ::mprotect(run, run_bytes, PROT_NONE);
    uncount_device(run_bytes);
    counters_.pages_unmapped += end - page;
    page = end;
  }
}

const sim_memory::address_range* sim_memory::find_range(std::uintptr_t addr, std::size_t bytes,
                                                        std::uintptr_t* base) const noexcept {
  auto it = ranges_.upper_bound(addr);
  if (it == ranges_.begin()) return nullptr;
  --it;
  const std::uintptr_t offset = addr - it->first;
  if (offset >= it->second.bytes || bytes > it->second.bytes - offset) return nullptr;
  *base = it->first;
  return &it->second;
}

sim_memory::address_range* sim_memory::find_range(std::uintptr_t addr, std::size_t bytes,
                                                  std::uintptr_t* base) noexcept {
  return const_cast<address_range*>(std::as_const(*this).find_range(addr, bytes, base));
}

void sim_memory::throw_bad_map(const void* addr, std::size_t bytes, const std::string& why) const {
  throw invalid_argument("map_physical(" + range_text(addr, bytes) + ") on " + name_ + ": " + why);
}

// --- pinned host memory ----------------------------------------------------------------------------

void* sim_memory::allocate_pinned(std::size_t bytes) noexcept {
  if (bytes > config_.pinned_host_capacity - counters_.pinned_used_bytes) return nullptr;
  void* ptr = map_anonymous(bytes, PROT_READ | PROT_WRITE);
  if (ptr == nullptr) return nullptr;
  try {
    pinned_.emplace(ptr, bytes);
  } catch (...) {
    ::munmap(ptr, bytes);
    return nullptr;
  }
  counters_.pinned_used_bytes += bytes;
  return ptr;
}

bool sim_memory::free_pinned(void* ptr) noexcept {
  auto it = pinned_.find(ptr);
  if (it == pinned_.end()) {
    ++counters_.invalid_releases;
    return false;
  }
  ::munmap(ptr, it->second);
  counters_.pinned_used_bytes -= it->second;
  pinned_.erase(it);
  return true;
}

// --- accounting ------------------------------------------------------------------------------------

void sim_memory::count_device(std::size_t bytes) noexcept {
  counters_.used_bytes += bytes;
  counters_.peak_used_bytes = std::max(counters_.peak_used_bytes, counters_.used_bytes);
}

void sim_memory::uncount_device(std::size_t bytes) noexcept { counters_.used_bytes -= bytes; }

}  // namespace spillway::detail
