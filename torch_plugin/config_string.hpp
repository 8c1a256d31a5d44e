// config_string: SPILLWAY_CONF, the settings string of spillway's PyTorch plugin and preload shim,
// in the style of PYTORCH_CUDA_ALLOC_CONF:
//
//   SPILLWAY_CONF="budget:8GiB,expandable_segments:True,backend:cuda,policy:dtr-frag"
//
// Contract
// - The text is a comma-separated list of key:value settings. Blanks around keys and values are
//   ignored; keys are case-sensitive; each key may appear once. An empty (or all-blank) text gives
//   the defaults.
// - Keys and values:
//     budget                    size (byte_size.hpp: 8GiB, 512MiB, 1e9)   cap on reserved bytes
//     budget_fraction           number in (0, 1]              cap as a fraction of device memory
//     expandable_segments       bool                          grow segments with VMM
//     expandable_address_range  size                          address space per expandable segment
//     max_split_size_mb         integer > 20 (MiB)            PyTorch's: oversize blocks are not split
//     backend                   cuda | sim                    the device spillway allocates from
//     sim_capacity              size                          memory of the simulated device
//     policy                    an eviction policy name (spillway::eviction::policy_names())
//     device                    integer >= 0                  the budget applies to this device only
//   Booleans are True, False, true, false, 1 or 0. budget and budget_fraction exclude each other.
// - Every bad input throws spillway::invalid_argument naming the key, the value and what was
//   expected; an unknown key lists the known ones. Nothing is read from the environment here: the
//   edges (pluggable_abi.cpp, preload_shim.cpp) pass getenv("SPILLWAY_CONF") in.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "spillway/allocator_config.hpp"

namespace spillway {

struct plugin_config {
  allocator_config allocator;                   // budget, expandable_segments, address range
  std::string backend = "cuda";                 // "cuda" or "sim"
  std::optional<double> budget_fraction;        // of each device's total memory
  std::string policy;                           // "" = the eviction engine's default
  std::optional<int> device;                    // the budget applies only to this device
  std::size_t sim_capacity = std::size_t{16} << 30;  // backend "sim": simulated device memory
};

plugin_config parse_config(std::string_view text);

// The budget of `device`, whose total memory is `device_total`, under `config`: budget, or
// budget_fraction * device_total rounded down, or unlimited_budget; unlimited_budget for every
// device but config.device when that is set.
std::size_t budget_for_device(const plugin_config& config, int device, std::size_t device_total);

// fraction x device_total bytes, rounded down, and at least 1 (a budget of 0 is refused): what
// budget_fraction and torch's memory fraction make a budget of. fraction is in [0, 1].
std::size_t fraction_of_memory(double fraction, std::size_t device_total) noexcept;

}  // namespace spillway
