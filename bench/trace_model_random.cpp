// trace_model_random: the random stress shape of trace_models.hpp.
//
// Sizes are log-uniform in three bands (60% 512 B..1 MiB, 35% 1..32 MiB, 5% 32..512 MiB). Each
// step allocates with probability 0.6 while live bytes are below `live_bytes` and frees a random
// live allocation otherwise, so the live bytes hover near the target. 80% of allocations use
// stream 0, the rest streams 1..streams-1; 10% of allocations get a record_stream onto another
// stream. What is live at the end stays live.
#include <cmath>
#include <vector>

#include "trace_model_kit.hpp"
#include "trace_models.hpp"

namespace spillway::trace {

void synthesize_random(const synth_options& o, trace_builder& builder) {
  portable_rng rng{o.seed};
  const auto streams = static_cast<std::uint64_t>(o.streams);
  std::vector<std::uint32_t> live;  // ids, in no particular order
  auto log_uniform = [&](double lo, double hi) {
    return static_cast<std::uint64_t>(std::exp(std::log(lo) + rng.uniform() * (std::log(hi) - std::log(lo))));
  };
  std::uint64_t emitted = 0;
  while (emitted < o.events) {
    builder.advance(1000 + rng.below(20000));
    const bool below_target = builder.live_bytes() < o.live_bytes;
    if (live.empty() || (below_target && rng.uniform() < 0.6) || (!below_target && rng.uniform() < 0.1)) {
      const double band = rng.uniform();
      const std::uint64_t size = band < 0.60   ? log_uniform(512, 1 << 20)
                                 : band < 0.95 ? log_uniform(1 << 20, 32 << 20)
                                               : log_uniform(32 << 20, 512 << 20);
      const std::uint32_t stream =
          streams > 1 && rng.uniform() < 0.2 ? static_cast<std::uint32_t>(1 + rng.below(streams - 1)) : 0;
      const std::uint32_t id = builder.alloc(size, stream);
      live.push_back(id);
      ++emitted;
      if (streams > 1 && emitted < o.events && rng.uniform() < 0.1) {
        const auto other = static_cast<std::uint32_t>((stream + 1 + rng.below(streams - 1)) % streams);
        builder.record_stream(id, other);
        ++emitted;
      }
    } else {
      const std::size_t i = static_cast<std::size_t>(rng.below(live.size()));
      builder.free(live[i]);
      live[i] = live.back();
      live.pop_back();
      ++emitted;
    }
  }
}

}  // namespace spillway::trace
