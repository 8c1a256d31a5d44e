// policy_makers: the constructors behind make_policy (policy_factory.cpp), one per policy file.
//
// Private to the eviction library. Every policy object is used by one engine at a time (choose()
// advances the policy's random generator); none allocates in choose().
#pragma once

#include <cstdint>
#include <memory>

#include "spillway/eviction/policy.hpp"

namespace spillway::eviction::detail {

std::unique_ptr<eviction_policy> make_dtr_policy(std::uint64_t seed);       // policy_dtr.cpp
std::unique_ptr<eviction_policy> make_dtr_frag_policy(std::uint64_t seed);  // policy_dtr.cpp
std::unique_ptr<eviction_policy> make_lru_policy();                         // policy_simple.cpp
std::unique_ptr<eviction_policy> make_largest_policy();                     // policy_simple.cpp

}  // namespace spillway::eviction::detail
