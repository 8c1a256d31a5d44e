// policy_factory.cpp: make_policy by name, the list of names, DTR's score, and candidate_view's
// default describe().
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "policy_makers.hpp"
#include "spillway/errors.hpp"

namespace spillway::eviction {
namespace {

struct policy_entry {
  std::string_view name;
  std::unique_ptr<eviction_policy> (*make)(std::uint64_t seed);
};

// The one list of policies: make_policy, policy_names and the error message all read it.
constexpr policy_entry k_policies[] = {
    {"dtr", &detail::make_dtr_policy},
    {"lru", [](std::uint64_t) { return detail::make_lru_policy(); }},
    {"largest", [](std::uint64_t) { return detail::make_largest_policy(); }},
    {"dtr-frag", &detail::make_dtr_frag_policy},
};

}  // namespace

// h = (cost + neighbourhood cost) / (size x horizon), the horizon being the predicted time to the
// buffer's next use where the engine has one (Note [Next-use prediction]: evicting what is needed
// last is Belady's choice), else DTR's staleness, the time since its last use, as its proxy.
// Size and horizon count as at least 1 so that an empty or just-touched buffer gives a finite
// score; a negative cost counts as 0, and a NaN cost or staleness ranks last (+inf), so a bad
// measurement never makes the favourite victim.
double dtr_score(const candidate_info& c) noexcept {
  constexpr double worst = std::numeric_limits<double>::infinity();
  const double cost = c.cost_ns + c.neighbourhood_cost_ns;
  const double horizon = std::isnan(c.next_use_ns) ? c.staleness_ns : c.next_use_ns;
  if (std::isnan(cost) || std::isnan(horizon)) return worst;
  const double size = std::max(1.0, static_cast<double>(c.size));
  const double h = std::max(0.0, cost) / (size * std::max(1.0, horizon));
  return std::isnan(h) ? worst : h;  // inf / inf
}

std::size_t candidate_view::cheapest_per_byte(std::span<std::size_t>) const { return 0; }

void candidate_view::describe(std::span<const std::size_t> indices,
                              std::span<candidate_info> out) const {
  const std::size_t n = std::min(indices.size(), out.size());
  for (std::size_t k = 0; k < n; ++k) out[k] = at(indices[k]);
}

std::unique_ptr<eviction_policy> make_policy(std::string_view name, std::uint64_t seed) {
  for (const policy_entry& p : k_policies) {
    if (p.name == name) return p.make(seed);
  }
  std::string choices;
  for (const policy_entry& p : k_policies) {
    if (!choices.empty()) choices += ", ";
    choices += p.name;
  }
  throw invalid_argument("make_policy: unknown eviction policy \"" + std::string(name) +
                         "\"; expected one of: " + choices);
}

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const policy_entry& p : k_policies) names.emplace_back(p.name);
  return names;
}

}  // namespace spillway::eviction
