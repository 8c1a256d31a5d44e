// activation_manager_impl.hpp: what the activation manager's files share, private to them. The
// contract is in activation_manager.hpp; the files are
//   activation_manager.cpp    options, lifetime, pack and unpack, statistics
//   activation_eviction.cpp   victim choice and eviction (spill or drop, by cost)
//   activation_spill.cpp      the copies out to host memory and back, and prefetch
//   activation_recompute.cpp  checkpoint segments, their generator states, and replays
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "activation_manager.hpp"

namespace spillway::torch_plugin {

namespace detail {

// The version of a tensor's counter; nullopt for one without (an inference tensor).
inline std::optional<std::uint32_t> version_of(const c10::VariableVersion& counter) {
  if (!counter.enabled()) return std::nullopt;
  return counter.current_version();
}
inline std::optional<std::uint32_t> version_of(const at::Tensor& t) {
  return t.defined() ? version_of(t.unsafeGetTensorImpl()->version_counter()) : std::nullopt;
}

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// The bytes of `storage` as a 1-D uint8 tensor of `nbytes` (the storage's own nbytes may be 0
// while it is evicted and being refilled).
at::Tensor byte_view(const c10::Storage& storage, std::size_t nbytes);

// The default generators of the CPU and of `cuda_devices`, set to a segment's state for a replay
// and put back afterwards, even when the replay throws.
struct generator_states {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;

  static generator_states capture(const std::vector<c10::DeviceIndex>& devices);
  void apply() const;
};

}  // namespace detail

enum class entry_state { resident, spilled, dropped };

// A tensor input of a segment: held through the manager (`held`, evictable) or, for a tensor it
// does not register (small, a parameter, not CPU or CUDA), as it is (`kept`).
struct segment_input {
  std::shared_ptr<activation_manager::saved> held;
  at::Tensor kept;
  std::optional<std::uint32_t> version;  // when the segment began (nullopt: no counter)
};

struct activation_manager::segment {
  segment_replay replay;
  std::vector<c10::DeviceIndex> cuda_devices;
  detail::generator_states rng;
  std::vector<segment_input> inputs;
  // False once it is seen (end_segment) to have modified an input in place: a replay would start
  // from the modified bytes, so nothing of it may be dropped.
  bool replayable = true;
  // Every pack while it ran, in order (nullopt: kept as it is). Weak references: they do not keep
  // a storage's memory, but they keep its StorageImpl's address from being reused by another
  // storage, whose entry a replay would otherwise take for this segment's and refill. With the
  // entry's seq: the same storage registered again (its entry let go, then saved by another
  // segment) is a new entry, not this segment's to refill.
  struct saved_storage {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    std::uint64_t seq = 0;
  };
  std::vector<std::optional<saved_storage>> saved;
  // What it returned (end_segment; nullopt: no storage, or no version counter), with each
  // tensor's version then: a tensor modified in place since is not what a replay returns, and
  // takes no lineage from it.
  std::vector<std::pair<std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>, std::uint32_t>>
      outputs;
  double cost_s = 0;       // its forward's time, once it has ended
  double began_s = 0;      // host clock (now_seconds) at begin_segment
  bool ended = false;
  std::optional<c10::Event> start, end;  // CUDA timing, read once complete
};
struct activation_manager::entry {
  c10::Storage storage;
  std::size_t nbytes = 0;
  c10::Device device{c10::DeviceType::CPU};
  std::size_t aliases = 0;
  std::size_t unpackable = 0;  // of the aliases, autograd's saves (pack): what unpack will read
  entry_state state = entry_state::resident;
  // Spilled bytes; and, for a resident entry restored ahead (prefetched), the same bytes kept
  // until its unpack: nothing but the manager's aliases holds an evictable storage, so nothing
  // writes it, and evicting it again needs no copy out (evict_one).
  at::Tensor host;
  std::optional<std::uint32_t> host_version;  // a kept copy's: the storage's version at its restore
  // CUDA: the copy the next user waits for. A resident entry's is its copy back (or the refill
  // of a replay, which made its bytes on the replay's stream), which a spill
  // waits for on the copy stream (copy_out); it does not keep the entry from being evicted. A
  // spilled entry's is its spill's copy out, or, evicted clean, the copy back before (which came
  // after that spill's copy out).
  std::optional<c10::Event> copy;
  // CUDA: the stream its current block was allocated on by a copy back or a replay's refill (a prefetch's may be
  // another than its readers'): a reader on another stream is recorded on the block (its free
  // then waits for that reader's work too).
  std::optional<c10::Stream> allocated_on;
  // CUDA: the stream current when it was saved or registered, which made its bytes (a side
  // stream's op, saved there): a spill's copy out waits for it as well as for the evicting
  // thread's stream, or it could read the block before they are written.
  std::optional<c10::Stream> saved_on;
  bool prefetched = false;  // restored ahead of its unpack, not unpacked since
  // The allocator its memory came from when it was last evicted (the pressure source's; nullptr:
  // none, or not spillway's memory): where a prefetch asks for room.
  const device_allocator* home = nullptr;
  std::shared_ptr<segment> lineage;      // the checkpoint segment that made it
  // The version counter of the tensor first registered (its views share it), and its value when
  // the lineage's bytes were the storage's: when it was saved or registered as an output, then
  // the end of the segment that saved it (unset for a segment not replayable). Dropped only while
  // the two agree (droppable): a storage modified in place since is not what a replay gives back.
  c10::VariableVersion version;
  std::optional<std::uint32_t> lineage_version;
  std::uint64_t seq = 0;
  double last_use = 0;
  // A recomputation refers to it (> 0): it is forgotten only afterwards (orphaned). Not a pin:
  // a member that is resident may be evicted while its segment is replayed, which reads only the
  // segment's inputs; one refilled is pinned until the recomputation returns.
  int users = 0;
  int pins = 0;                          // > 0: not evictable
  std::size_t resident_at = 0;           // its index in resident_, while resident
  bool orphaned = false;                 // its last handle went while it had users
};

namespace detail {
// A resident entry's kept host copy (a prefetch's) is still its bytes: the version counter says
// nothing wrote the storage since its restore.
inline bool kept_copy_current(const activation_manager::entry& e) {
  return e.state == entry_state::resident && e.host.defined() && e.host_version.has_value() &&
         version_of(e.version) == e.host_version;
}
}  // namespace detail


}  // namespace spillway::torch_plugin
