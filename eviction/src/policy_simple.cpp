// policy_simple.cpp: "lru" and "largest", which ask the candidate_view for their one candidate.
//
// Both cost what the view's index costs (O(1) for least_recently_used, O(log n) for largest) and
// ignore the request: they are the baselines the DTR policies are measured against.
#include <optional>

#include "policy_makers.hpp"

namespace spillway::eviction::detail {
namespace {

std::optional<buffer_id> id_of(const std::optional<candidate_info>& c) {
  if (!c) return std::nullopt;
  return c->id;
}

class lru_policy final : public eviction_policy {
 public:
  std::string_view name() const noexcept override { return "lru"; }
  std::optional<buffer_id> choose(const candidate_view& candidates,
                                  const eviction_request&) override {
    if (candidates.count() == 0) return std::nullopt;
    return id_of(candidates.least_recently_used());
  }
};

class largest_policy final : public eviction_policy {
 public:
  std::string_view name() const noexcept override { return "largest"; }
  std::optional<buffer_id> choose(const candidate_view& candidates,
                                  const eviction_request&) override {
    if (candidates.count() == 0) return std::nullopt;
    return id_of(candidates.largest());
  }
};

}  // namespace

std::unique_ptr<eviction_policy> make_lru_policy() { return std::make_unique<lru_policy>(); }
std::unique_ptr<eviction_policy> make_largest_policy() { return std::make_unique<largest_policy>(); }

}  // namespace spillway::eviction::detail
