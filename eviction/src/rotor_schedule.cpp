// rotor_schedule: the chain model, input validation, and the independent schedule simulator.
//
// The simulator knows nothing of the planner's recurrence: it replays ops against the memory model of
// rotor_planner.hpp one by one, so a planner bug (a missing recompute, a value counted twice or not
// at all) shows up as an invalid schedule or a peak above the budget.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "rotor_model.hpp"
#include "spillway/errors.hpp"

namespace spillway::eviction {
namespace detail {
namespace {

std::string cost_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+inf" : "-inf";
  std::string s = std::to_string(v);
  return s;
}

void check_cost(const char* who, std::size_t stage, const char* field, double v) {
  if (std::isfinite(v) && v >= 0) return;
  throw spillway::invalid_argument(std::string(who) + ": stage " + std::to_string(stage) + " " + field +
                                   " is " + cost_text(v) + "; expected a finite value >= 0");
}

}  // namespace

chain_model make_model(const chain& c, const char* who) {
  if (c.stages.empty())
    throw spillway::invalid_argument(std::string(who) + ": the chain has no stages; expected at least one");
  if (c.stages.size() > static_cast<std::size_t>(std::numeric_limits<int>::max() / 4))
    throw spillway::invalid_argument(std::string(who) + ": the chain has " + std::to_string(c.stages.size()) +
                                     " stages; expected far fewer");
  // Every sum the planner forms adds a handful of these; capping the total keeps them exact.
  constexpr std::size_t size_cap = std::numeric_limits<std::size_t>::max() / 16;
  std::size_t total = c.input_bytes;
  auto add = [&](std::size_t v) {
    total = (v > size_cap || total > size_cap - v) ? size_cap + 1 : total + v;
  };

  chain_model m;
  const int L = static_cast<int>(c.stages.size());
  m.length = L;
  m.x.assign(L + 2, 0);
  m.xbar.assign(L + 1, 0);
  m.fwd_overhead.assign(L + 1, 0);
  m.bwd_overhead.assign(L + 1, 0);
  m.fwd_cost.assign(L + 1, 0);
  m.bwd_cost.assign(L + 1, 0);
  m.x[0] = c.input_bytes;
  for (int i = 1; i <= L; ++i) {
    const chain_stage& s = c.stages[i - 1];
    check_cost(who, i - 1, "forward_cost", s.forward_cost);
    check_cost(who, i - 1, "backward_cost", s.backward_cost);
    if (s.xbar_bytes < s.x_bytes)
      throw spillway::invalid_argument(std::string(who) + ": stage " + std::to_string(i - 1) +
                                       " xbar_bytes is " + format_bytes(s.xbar_bytes) +
                                       ", below its x_bytes " + format_bytes(s.x_bytes) +
                                       "; expected xbar_bytes >= x_bytes (xbar holds the output)");
    add(s.x_bytes);
    add(s.xbar_bytes);
    add(s.forward_overhead_bytes);
    add(s.backward_overhead_bytes);
    m.x[i] = s.x_bytes;
    m.xbar[i] = s.xbar_bytes;
    m.fwd_overhead[i] = s.forward_overhead_bytes;
    m.bwd_overhead[i] = s.backward_overhead_bytes;
    m.fwd_cost[i] = s.forward_cost;
    m.bwd_cost[i] = s.backward_cost;
    m.base_cost += s.forward_cost + s.backward_cost;
  }
  if (total > size_cap)
    throw spillway::invalid_argument(std::string(who) + ": the chain's sizes add up to more than " +
                                     format_bytes(size_cap) + "; expected a total that fits in memory");
  return m;
}

chain_model discretise(const chain_model& bytes, std::size_t slot, rounding how) {
  chain_model m = bytes;
  const bool up = how == rounding::up;
  for (auto* sizes : {&m.x, &m.xbar, &m.fwd_overhead, &m.bwd_overhead})
    for (std::size_t& v : *sizes) v = v / slot + (up && v % slot != 0 ? 1 : 0);
  return m;
}

std::vector<schedule_op> store_all_schedule(int length) {
  std::vector<schedule_op> ops;
  ops.reserve(2 * length + 1);
  for (int s = 0; s < length; ++s) ops.push_back({op_kind::forward_save_all, s});
  ops.push_back({op_kind::loss, length});
  for (int s = length - 1; s >= 0; --s) ops.push_back({op_kind::backward, s});
  return ops;
}

}  // namespace detail

std::string to_string(op_kind kind) {
  switch (kind) {
    case op_kind::forward_checkpoint:
      return "Fck";
    case op_kind::forward_no_save:
      return "Fn";
    case op_kind::forward_save_all:
      return "Fall";
    case op_kind::loss:
      return "Loss";
    case op_kind::backward:
      return "B";
  }
  return "op(" + std::to_string(static_cast<int>(kind)) + ")";
}

namespace {
std::string describe_op(const schedule_op& op) {
  return op.kind == op_kind::loss ? to_string(op.kind) : to_string(op.kind) + std::to_string(op.stage);
}
}  // namespace

std::string describe_schedule(const std::vector<schedule_op>& ops) {
  std::string text;
  for (const schedule_op& op : ops) {
    if (!text.empty()) text += ' ';
    text += describe_op(op);
  }
  return text;
}

schedule_simulation simulate_schedule(const chain& c, const std::vector<schedule_op>& ops) {
  const detail::chain_model m = detail::make_model(c, "simulate_schedule");
  const int L = m.length;
  // Per value x_i: absent, a plain copy nobody has kept yet, a plain copy a forward kept (a
  // checkpoint), or inside xbar_i. x_0 is the caller's: always there, never dropped.
  enum class held : unsigned char { none, temp, kept, all };
  std::vector<held> st(L + 1, held::none);
  st[0] = held::kept;
  auto plain = [](held h) { return h == held::temp || h == held::kept; };
  int next = L + 1;  // the stage whose backward runs next; L + 1: the loss has not run
  std::size_t mem = m.x[0];

  schedule_simulation r;
  r.peak_bytes = mem;
  auto fail = [&](std::size_t k, const std::string& why) {
    r.error = k < ops.size() ? "op " + std::to_string(k) + " (" + describe_op(ops[k]) + "): " + why : why;
    return r;
  };
  auto value = [](int i) { return "x" + std::to_string(i); };

  for (std::size_t k = 0; k < ops.size(); ++k) {
    const schedule_op& op = ops[k];
    std::size_t peak = 0;
    if (op.kind == op_kind::loss) {
      if (op.stage != L)
        return fail(k, "the loss is stage " + std::to_string(L) + " (one past the last stage)");
      if (next != L + 1) return fail(k, "the loss already ran");
      if (st[L] == held::none) return fail(k, "the chain output " + value(L) + " is not in memory");
      peak = mem + m.x[L];
      mem += m.x[L];
      if (plain(st[L])) {
        mem -= m.x[L];
        st[L] = held::none;
      }
      next = L;
    } else if (op.stage < 0 || op.stage >= L) {
      return fail(k, "stage out of range; expected 0.." + std::to_string(L - 1));
    } else if (op.kind == op_kind::backward) {
      const int i = op.stage + 1;
      if (next == L + 1) return fail(k, "a backward before the loss");
      if (i != next)
        return fail(k, i > next ? "this backward already ran"
                                : "out of order; the next backward is stage " + std::to_string(next - 1));
      if (st[i] != held::all) return fail(k, "xbar of this stage is not in memory (no forward_save_all)");
      if (st[i - 1] == held::none) return fail(k, "its input " + value(i - 1) + " is not in memory");
      peak = mem + m.x[i - 1] + m.bwd_overhead[i];
      mem = mem + m.x[i - 1] - m.xbar[i] - m.x[i];  // adds delta_{i-1}, drops xbar_i and delta_i
      st[i] = held::none;
      if (i - 1 >= 1 && plain(st[i - 1])) {
        mem -= m.x[i - 1];
        st[i - 1] = held::none;
      }
      next = i - 1;
      r.cost += m.bwd_cost[i];
    } else {
      const int i = op.stage + 1;
      const bool save_all = op.kind == op_kind::forward_save_all;
      if (next < i) return fail(k, "this stage's backward already ran");
      if (!save_all && next == i)
        return fail(k, "its output " + value(i) + " can only feed stages whose backward already ran");
      if (st[i - 1] == held::none) return fail(k, "its input " + value(i - 1) + " is not in memory");
      if (st[i] != held::none) return fail(k, value(i) + " is already in memory");
      if (op.kind == op_kind::forward_no_save && i == 1) return fail(k, "it would drop the chain input x0");
      const std::size_t out = save_all ? m.xbar[i] : m.x[i];
      peak = mem + out + m.fwd_overhead[i];
      mem += out;
      if (op.kind == op_kind::forward_no_save) {
        if (st[i - 1] == held::kept) r.persistent = false;
        if (plain(st[i - 1])) {
          mem -= m.x[i - 1];
          st[i - 1] = held::none;
        }
      } else if (st[i - 1] == held::temp) {
        st[i - 1] = held::kept;
      }
      st[i] = save_all ? held::all : held::temp;
      r.cost += m.fwd_cost[i];
    }
    r.peak_bytes = std::max({r.peak_bytes, peak, mem});
  }
  if (next != 0)
    return fail(ops.size(),
                next == L + 1 ? "the schedule ends before the loss"
                              : "the schedule ends before the backward of stage " + std::to_string(next - 1));
  r.valid = true;
  return r;
}

}  // namespace spillway::eviction
