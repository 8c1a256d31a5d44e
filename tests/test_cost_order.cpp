// test_cost_order: the candidates' order by cost per byte (eviction/src/cost_order.hpp).
//
// It proves, against a reference (a sorted std::set of (key, id)) through 20,000 random inserts,
// erases and key changes, with many equal keys and infinite ones: cheapest() always hands out the
// first min(out.size(), 16) records of the order, cheapest first, however the cached prefix was
// repaired or topped up, but none with an infinite key; a request for more than 16 gets 16; an
// empty order gets none; a key change to the same value moves nothing. And that placement waits
// for the next read: records inserted or changed wait, each once however often its key changed,
// an erased one stops waiting, and settle() or cheapest() places them all.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "../eviction/src/cost_order.hpp"  // internal: tested directly

namespace {

struct record {
  boost::intrusive::set_member_hook<boost::intrusive::link_mode<boost::intrusive::normal_link>> cost_hook;
  boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::normal_link>> wait_hook;
  bool cost_waiting = false;
  double cost_per_byte = 0;
  struct {
    std::uint64_t value = 0;
  } id;
  std::size_t candidate_index = 0;
};

using order = spillway::eviction::detail::cost_order<record>;
using reference = std::set<std::pair<double, std::uint64_t>>;

// The first `want` ids of the reference with a finite key, as cheapest() should hand out their
// candidate_index.
std::vector<std::size_t> expected(const reference& ref, std::size_t want) {
  std::vector<std::size_t> out;
  for (auto it = ref.begin(); it != ref.end() && out.size() < want && std::isfinite(it->first); ++it) {
    out.push_back(it->second + 1000);
  }
  return out;
}

// n records, record i with id i and candidate_index i, inserted with key(i).
template <class Key>
std::vector<record> insert_records(order& o, std::size_t n, Key key) {
  std::vector<record> records(n);
  for (std::size_t i = 0; i < n; ++i) {
    records[i].id.value = i;
    records[i].candidate_index = i;
    o.insert(records[i], key(i));
  }
  return records;
}

std::vector<std::size_t> cheapest(const order& o, std::size_t want) {
  std::vector<std::size_t> out(want, 0);
  out.resize(o.cheapest(out));
  return out;
}

}  // namespace

TEST_CASE("cheapest hands out the prefix of the order as records come, go and change") {
  constexpr std::size_t n = 300;
  std::vector<record> records(n);
  for (std::size_t i = 0; i < n; ++i) {
    records[i].id.value = i;
    records[i].candidate_index = i + 1000;
  }
  std::vector<bool> in(n, false);
  order o;
  reference ref;
  std::mt19937_64 rng(7);
  // Keys from a small set (ties broken by id), a continuous range, and infinity.
  const auto key = [&] {
    const std::uint64_t kind = rng() % 3;
    if (kind == 0) return static_cast<double>(rng() % 8);
    if (kind == 1) return std::uniform_real_distribution<double>(0, 8)(rng);
    return rng() % 10 == 0 ? std::numeric_limits<double>::infinity() : 3.0;
  };
  for (int step = 0; step < 20000; ++step) {
    const std::size_t i = rng() % n;
    record& r = records[i];
    const std::uint64_t action = rng() % 4;
    if (!in[i]) {
      const double k = key();
      o.insert(r, k);
      ref.insert({k, i});
      in[i] = true;
    } else if (action == 0) {
      ref.erase({r.cost_per_byte, i});
      o.erase(r);
      in[i] = false;
    } else {
      const double k = action == 1 ? r.cost_per_byte : key();  // sometimes the same key
      ref.erase({r.cost_per_byte, i});
      o.reorder(r, k);
      ref.insert({k, i});
      CHECK(r.cost_per_byte == k);
    }
    // Asking sometimes for a short prefix, sometimes for the whole of it, sometimes not at all
    // (the cache is then repaired over several changes before it is read).
    const std::uint64_t ask = rng() % 4;
    if (ask == 0) continue;
    const std::size_t want = ask == 1 ? 1 + rng() % 5 : 16;
    REQUIRE(cheapest(o, want) == expected(ref, want));
  }
  for (std::size_t i = 0; i < n; ++i) {  // empty it: nothing is handed out
    if (in[i]) o.erase(records[i]);
  }
  CHECK(cheapest(o, 16).empty());
}

TEST_CASE("cheapest hands out at most 16, cheapest first") {
  order o;
  // The last inserted is the cheapest.
  std::vector<record> records =
      insert_records(o, 40, [](std::size_t i) { return static_cast<double>(40 - i); });
  const std::vector<std::size_t> got = cheapest(o, 32);
  REQUIRE(got.size() == 16);
  for (std::size_t k = 0; k < got.size(); ++k) CHECK(got[k] == 39 - k);
  for (record& r : records) o.erase(r);
}

TEST_CASE("a changed record waits for the next read, once, and is placed where its last key puts it") {
  order o;
  std::vector<record> records =
      insert_records(o, 6, [](std::size_t i) { return static_cast<double>(10 + i); });
  CHECK(o.waiting() == 6);  // inserted, not placed
  o.settle();
  CHECK(o.waiting() == 0);
  CHECK(cheapest(o, 3) == std::vector<std::size_t>{0, 1, 2});

  // Record 5 changes three times, record 4 twice: two wait, each once; the last keys count.
  o.reorder(records[5], 1.0);
  o.reorder(records[5], 20.0);
  o.reorder(records[5], 0.5);
  o.reorder(records[4], 0.25);
  o.reorder(records[4], 11.5);
  CHECK(o.waiting() == 2);
  CHECK(records[5].cost_waiting);
  CHECK_FALSE(records[0].cost_waiting);
  o.reorder(records[4], 11.5);  // the same key: nothing
  CHECK(o.waiting() == 2);

  // A waiting record that goes is never handed out, and no longer waits.
  o.erase(records[4]);
  CHECK_FALSE(records[4].cost_waiting);
  CHECK(o.waiting() == 1);
  CHECK(cheapest(o, 16) == std::vector<std::size_t>{5, 0, 1, 2, 3});  // cheapest() places record 5
  CHECK(o.waiting() == 0);

  // The prefix, cached before the changes, follows: the cheapest changes to the dearest.
  o.reorder(records[5], 99.0);
  o.reorder(records[0], 0.1);
  CHECK(cheapest(o, 2) == std::vector<std::size_t>{0, 1});
  CHECK(cheapest(o, 16) == std::vector<std::size_t>{0, 1, 2, 3, 5});
  for (std::size_t i = 0; i < records.size(); ++i) {
    if (i != 4) o.erase(records[i]);
  }
  CHECK(cheapest(o, 16).empty());
}
