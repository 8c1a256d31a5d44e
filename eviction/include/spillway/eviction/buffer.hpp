// buffer: how the eviction engine names and describes an evictable buffer.
//
// - buffer_id is a handle, not a pointer: a buffer's device pointer changes when it is evicted and
//   brought back, so the only way to its bytes is eviction_engine::pin, which returns the pointer
//   valid for as long as the pin lives (Note [Eviction state machine] in docs/eviction.md).
// - Ids are generation-checked: an id used after forget() is reported as such, never confused with
//   a newer buffer that reuses the slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace spillway::eviction {

struct buffer_id {
  std::uint64_t value = 0;  // 0 is never a valid id

  bool valid() const noexcept { return value != 0; }
  friend constexpr bool operator==(buffer_id a, buffer_id b) noexcept { return a.value == b.value; }
  friend constexpr bool operator!=(buffer_id a, buffer_id b) noexcept { return a.value != b.value; }
};

struct node_id {
  std::uint64_t value = 0;  // 0: no lineage

  bool valid() const noexcept { return value != 0; }
  friend constexpr bool operator==(node_id a, node_id b) noexcept { return a.value == b.value; }
  friend constexpr bool operator!=(node_id a, node_id b) noexcept { return a.value != b.value; }
};

//   resident   on the device, at its current pointer
//   spilling   its device copy is being copied to pinned host memory; the device block is freed
//              in stream order once the copy completes
//   spilled    only the host copy exists
//   dropped    no copy exists; it will be recomputed from its lineage
//   restoring  being copied back (or recomputed); usable in stream order on its stream
enum class buffer_state : std::uint8_t { resident, spilling, spilled, dropped, restoring };

constexpr std::string_view to_string(buffer_state s) noexcept {
  switch (s) {
    case buffer_state::resident: return "resident";
    case buffer_state::spilling: return "spilling";
    case buffer_state::spilled: return "spilled";
    case buffer_state::dropped: return "dropped";
    case buffer_state::restoring: return "restoring";
  }
  return "?";
}

// How a buffer may be evicted. automatic: the cost model picks spill or drop per eviction.
enum class eviction_mode : std::uint8_t { automatic, spill, drop };

struct buffer_options {
  node_id producer;                // the lineage node that computes this buffer (none: spill only)
  std::uint32_t output_index = 0;  // which output of `producer` it is
  bool evictable = true;           // false: registered for bookkeeping, never evicted
  eviction_mode mode = eviction_mode::automatic;
};

}  // namespace spillway::eviction
