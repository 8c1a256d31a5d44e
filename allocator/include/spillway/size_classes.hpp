// size_classes: how a request is rounded, which pool serves it and how big a segment it gets.
//
// The table (the same shape as PyTorch's, so traces replay like for like; see
// Note [Size table] in docs/design.md):
//
//   request r (bytes)            rounded to            pool    new segment
//   1 .. 1 MiB                   multiple of 512 B     small   2 MiB
//   1 MiB+1 .. 10 MiB - 1        multiple of 512 B     large   20 MiB
//   10 MiB ..                    multiple of 512 B     large   rounded up to 2 MiB
//
// The pool and segment columns read the rounded size, as PyTorch's do: a request of
// 10 MiB - 511 .. 10 MiB - 1 rounds to 10 MiB and gets a 10 MiB segment.
//
// A free block is split when the remainder is worth keeping: >= 512 B in the small pool,
// > 1 MiB in the large pool. Requests above max_request_size are invalid input (no device has
// that much address space); requests of 0 bytes are invalid input too.
//
// Everything here is constexpr and branch-light: it runs on the allocation fast path.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway::size_classes {

inline constexpr std::size_t min_block_size = 512;
inline constexpr std::size_t small_size = std::size_t{1} << 20;          // 1 MiB
inline constexpr std::size_t small_segment_size = std::size_t{2} << 20;  // 2 MiB
inline constexpr std::size_t min_large_alloc = std::size_t{10} << 20;    // 10 MiB
inline constexpr std::size_t large_segment_size = std::size_t{20} << 20; // 20 MiB
inline constexpr std::size_t segment_rounding = std::size_t{2} << 20;    // 2 MiB
inline constexpr std::size_t max_request_size = std::size_t{1} << 48;    // 256 TiB

constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}

// The rounded size of a request; the caller has checked 0 < r <= max_request_size.
constexpr std::size_t round_size(std::size_t r) noexcept { return round_up(r, min_block_size); }

constexpr bool is_small(std::size_t rounded) noexcept { return rounded <= small_size; }

// The size of a fresh segment for a rounded request.
constexpr std::size_t segment_size(std::size_t rounded) noexcept {
  if (rounded <= small_size) return small_segment_size;
  if (rounded < min_large_alloc) return large_segment_size;
  return round_up(rounded, segment_rounding);
}

// The smallest segment that can still serve a rounded request: used when a budget leaves less
// room than segment_size() asks for.
constexpr std::size_t min_segment_size(std::size_t rounded) noexcept {
  return rounded <= small_size ? small_segment_size : round_up(rounded, segment_rounding);
}

// Whether a free block of `block_size` serving `rounded` bytes is split.
constexpr bool should_split(std::size_t block_size, std::size_t rounded) noexcept {
  const std::size_t remaining = block_size - rounded;
  return is_small(rounded) ? remaining >= min_block_size : remaining > small_size;
}

}  // namespace spillway::size_classes
