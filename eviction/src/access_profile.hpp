// access_profile.hpp (internal): when each buffer will be read next, predicted from the last step.
//
// A training step repeats: the same operations read buffers registered in the same order. Once
// the caller marks steps (eviction_engine::begin_step), the profile records, for the step under
// way, every access event (one pin or pin_all call: one operation's reads) with its time since the
// step began, and which of the step's buffers it read, a buffer named by its key: its ordinal
// among the buffers registered in the step. At the next begin_step the record becomes the profile,
// and a candidate's next use is predicted as the time, in the recorded step, from the current
// event to the next event that read its key. See Note [Next-use prediction] in docs/eviction.md.
//
// Contract
// - A prediction is a hint for the policy, never needed for correctness: a program that changes
//   between steps gets worse victims, not wrong data. Keys whose size differs from the recorded
//   one, buffers registered outside the current step, and events beyond the recorded ones are not
//   predicted (NaN), nor is a key once one of its reads in the step was not in the record at
//   that point (the program diverged for it). A key the recorded step did not read again is predicted beyond the step's
//   end: the time left in the step plus a whole step (later than any read within it).
// - Accesses of the current step that the profile does not show at that event are counted
//   (mismatches()), so a caller can see that the program diverged.
// - Recording is amortised O(1) per access and allocates nothing once its vectors have grown to a
//   step's size (the record and the profile swap their storage at each step). A prediction is in
//   two parts: next_read (a binary search in the key's recorded events), which the engine keeps
//   in the candidate's record since it holds while the buffer is not read, and distance_ns (two
//   reads of the event times), at each decision.
// - Not thread-safe: the engine calls it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace spillway::eviction::detail {

class access_profile {
 public:
  static constexpr std::uint32_t no_key = std::numeric_limits<std::uint32_t>::max();
  static constexpr std::uint32_t no_event = no_key;        // next_read: no prediction
  static constexpr std::uint32_t beyond_step = no_key - 1;  // next_read: not read again in the step

  // A buffer's key in the step it was registered in (no_key before the first step).
  struct step_key {
    std::uint64_t step = 0;
    std::uint32_t ordinal = no_key;
  };

  // Ends the step under way (its record becomes the profile) and starts step number steps() + 1.
  void begin_step(std::uint64_t now_ns);
  std::uint64_t steps() const noexcept { return steps_; }

  // The key for a buffer of `size` bytes registered now.
  step_key on_register(std::size_t size);
  // An access event (one operation's reads) begins at now_ns; on_read names each buffer it reads
  // (keys of other steps and no_key are skipped).
  void begin_event(std::uint64_t now_ns);
  void on_read(step_key key);

  // The recorded event of the next read of `key` (of `size` bytes) after the current event:
  // no_event when unknown, beyond_step when the recorded step did not read it again.
  std::uint32_t next_read(step_key key, std::size_t size) const noexcept;
  // ns from the current event to `next_read` as the recorded step timed them: NaN for no_event,
  // and when the current event has reached or passed it (the read did not come: diverged) or has
  // passed the recorded ones; past the step's end (see above) for beyond_step.
  double distance_ns(std::uint32_t next_read) const noexcept;
  // Whether predictions can be made at all: a step with registrations has been recorded.
  bool predicting() const noexcept { return !profile_.sizes.empty(); }
  std::uint64_t mismatches() const noexcept { return mismatches_; }

 private:
  struct record {
    std::vector<std::uint64_t> event_ns;       // time of each event since the step began
    std::vector<std::uint64_t> reads;          // (key << 32 | event), in event order
    std::vector<std::size_t> sizes;            // by key
  };
  struct profile {
    std::vector<std::uint64_t> event_ns;
    std::vector<std::uint32_t> first;          // by key: its reads are events[first[k], first[k+1])
    std::vector<std::uint32_t> events;         // each key's events, ascending
    std::vector<std::size_t> sizes;
  };
  bool recorded_read(std::uint32_t key, std::uint32_t event) const noexcept;

  std::uint64_t steps_ = 0;
  std::uint64_t step_start_ns_ = 0;
  std::uint32_t event_ = no_key;               // the current event of the step (no_key: none yet)
  record record_;
  profile profile_;
  std::vector<std::uint32_t> scratch_;         // counting sort of the record by key
  std::vector<bool> diverged_;                 // by key of the profile: read off the record this step
  std::uint64_t mismatches_ = 0;
};

}  // namespace spillway::eviction::detail
