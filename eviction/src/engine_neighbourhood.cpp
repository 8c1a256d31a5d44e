// engine_neighbourhood.cpp: DTR's evicted neighbourhood, kept exact and cached on every buffer.
//
// DTR charges a victim its own recompute cost plus that of the dropped buffers next to it in the
// lineage graph, which dropping it would tie to it (e*, Note [Eviction policies]). Here the graph's
// vertices are the registered buffers, and u, m are adjacent when u is an input of m's producer
// (or the other way round), or when both are outputs of one node (siblings: recomputing one
// brings the other back with it). The dropped buffers fall into connected components, the classes
// (registry.hpp: dtr_class), each with its summed cost and its boundary: the buffers next to a
// member, with their edge counts. A class's cost counts each node once, however many of its
// outputs are members: the dropped outputs of a node are adjacent, so they are always in one
// class, and one of them holds the node's cost (node_entry::cost_holder, with member_cost_ns; the
// others hold 0; when it comes back, a dropped sibling takes the cost over). Every buffer that is
// not dropped keeps neighbourhood_ns, the sum of the costs of the distinct classes next to it,
// and a candidate's record keeps what dropping it would add beyond its own cost
// (charged_neighbourhood_locked: without its producer's cost, when a dropped sibling's class
// already counts it), so that a decision reads one number instead of walking producers,
// consumers and classes.
//
// Upkeep, each step proportional to what it touches, never to the number of buffers:
//   drop t         t leaves the boundaries it was on; the classes next to it merge with it (the
//                  smaller classes' members move to the largest); the boundary of the result is
//                  the union of theirs and t's other neighbours, and each buffer on it moves by
//                  the new class cost minus the costs of the classes it was next to.
//   bring t back   t leaves its class C. With at most one dropped neighbour, or only dropped
//                  siblings (adjacent to each other), C without t is still connected (a path
//                  through t would use two of its neighbours): C's cost falls by t's (unless a
//                  sibling takes it over), neighbours whose only edge into C was t leave its
//                  boundary, t joins it.
//                  With two or more, C may fall apart: its members are sorted into components
//                  again (one walk over C) and the boundaries rebuilt.
//   register       a new buffer joins the boundaries of the classes next to it (its inputs').
//   forget         the buffer leaves the graph: its class, as above, then every boundary.
// set_lineage is a removal and an insertion. Buffers are told apart as members by `cls`, so a
// buffer whose state says dropped while it is being taken out of the graph is handled as what it
// is in the graph. A step that runs out of host memory gives the estimate up for good (every
// neighbourhood cost 0 from then on) rather than leave classes half updated.
#include <algorithm>
#include <chrono>

#include "engine_impl.hpp"

namespace spillway::eviction {

using detail::buffer_entry;
using detail::dtr_class;
using detail::node_entry;

namespace {

// Calls f(u) for each edge between e and another buffer of the graph: its producer's inputs and
// other outputs, and the outputs of the nodes that read it. An input read twice is two edges,
// seen from both ends.
template <class F>
void for_each_neighbour(const buffer_entry& e, F&& f) {
  if (e.producer != nullptr) {
    for (buffer_entry* in : e.producer->inputs) {
      if (in != &e && in->in_graph) f(*in);
    }
    for (buffer_entry* sibling : e.producer->outputs) {
      if (sibling != nullptr && sibling != &e && sibling->in_graph) f(*sibling);
    }
  }
  for (const node_entry* c : e.consumers) {
    for (buffer_entry* out : c->outputs) {
      if (out != nullptr && out != &e && out->in_graph) f(*out);
    }
  }
}

dtr_class::neighbour* find_neighbour(dtr_class& c, const buffer_entry& u) noexcept {
  for (dtr_class::neighbour& n : c.boundary) {
    if (n.buffer == &u) return &n;
  }
  return nullptr;
}

// Whether m's leaving c may leave c's earliest next read too late (no prediction: nothing to keep).
bool held_earliest(const dtr_class& c, const buffer_entry& m) noexcept {
  return c.next_read != detail::access_profile::no_event && m.next_read == c.next_read;
}

// The earliest next read of c's members: a walk over them, for when the member that held it
// leaves.
std::uint32_t earliest_next_read(const dtr_class& c) noexcept {
  std::uint32_t earliest = detail::access_profile::no_event;
  for (const buffer_entry* m : c.members) earliest = std::min(earliest, m->next_read);
  return earliest;
}

void erase_neighbour(dtr_class& c, dtr_class::neighbour* n) noexcept {
  *n = c.boundary.back();
  c.boundary.pop_back();
}

// The dropped sibling of e (another output of its producer, a member of a class) that holds the
// producer's cost in its class, or null. Dropped siblings are adjacent, so all of them are in one
// class, and exactly one of them holds the cost.
buffer_entry* cost_holding_sibling(const buffer_entry& e) noexcept {
  buffer_entry* holder = e.producer != nullptr ? e.producer->cost_holder : nullptr;
  return holder != &e ? holder : nullptr;
}

// Another dropped output of t's producer, a member (in t's class), or null: one walk over the
// outputs, when the holder leaves.
buffer_entry* member_sibling(const buffer_entry& t) noexcept {
  for (buffer_entry* s : t.producer->outputs) {
    if (s != nullptr && s != &t && s->cls != nullptr) return s;
  }
  return nullptr;
}

}  // namespace

// Called for every buffer next to a class whenever the class changes, after its next read is
// current: the candidate's record follows both.
void eviction_engine::impl::set_neighbourhood_locked(buffer_entry& e, double cost_ns) noexcept {
  e.neighbourhood_ns = cost_ns;
  if (!candidates.contains(e)) return;
  detail::candidate_record& r = candidates.record(e);
  r.neighbourhood_ns = static_cast<float>(charged_neighbourhood_locked(e));
  r.next_read = needed_next_locked(e);
  candidates.reorder(e, cost_per_byte_locked(r));
}

double eviction_engine::impl::charged_neighbourhood_locked(const buffer_entry& e) const noexcept {
  const buffer_entry* s = e.cls == nullptr ? cost_holding_sibling(e) : nullptr;
  return s == nullptr ? e.neighbourhood_ns : std::max(0.0, e.neighbourhood_ns - s->member_cost_ns);
}

std::uint32_t eviction_engine::impl::needed_next_locked(const buffer_entry& e) const noexcept {
  if (e.next_read == detail::access_profile::no_event || e.neighbourhood_ns <= 0) return e.next_read;
  return std::min(e.next_read, dependants_next_read_locked(e));
}

dtr_class* eviction_engine::impl::make_class_locked() {
  if (idle_classes.empty()) {
    class_records.push_back(std::make_unique<dtr_class>());
    idle_classes.reserve(class_records.size());  // so that free_class_locked never allocates
    return class_records.back().get();
  }
  dtr_class* c = idle_classes.back();
  idle_classes.pop_back();
  return c;
}

void eviction_engine::impl::free_class_locked(dtr_class* c) noexcept {
  c->cost_ns = 0;
  c->next_read = detail::access_profile::no_event;
  c->members.clear();  // keeps the capacity for the next class
  c->boundary.clear();
  idle_classes.push_back(c);  // reserved in make_class_locked
}

void eviction_engine::impl::forget_class_next_reads_locked() noexcept {
  for (const std::unique_ptr<dtr_class>& c : class_records) {
    c->next_read = detail::access_profile::no_event;
    for (buffer_entry* m : c->members) m->next_read = detail::access_profile::no_event;
  }
}

void eviction_engine::impl::lose_neighbourhood_locked() noexcept {
  neighbourhood_lost = true;
  buffers.for_each([&](buffer_entry& e) {
    if (e.producer != nullptr) e.producer->cost_holder = nullptr;
    e.cls = nullptr;
    set_neighbourhood_locked(e, 0);
  });
  idle_classes.clear();
  class_records.clear();
}

namespace {
// Times one upkeep step into engine_stats (steps are drops and recomputes, not pins: two clock
// reads are cheap next to them).
class upkeep_timer {
 public:
  explicit upkeep_timer(engine_stats& s) : stats_(s), start_(std::chrono::steady_clock::now()) {}
  ~upkeep_timer() {
    ++stats_.upkeep_steps;
    stats_.upkeep_time_ns +=
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start_).count();
  }
  upkeep_timer(const upkeep_timer&) = delete;
  upkeep_timer& operator=(const upkeep_timer&) = delete;

 private:
  engine_stats& stats_;
  std::chrono::steady_clock::time_point start_;
};
}  // namespace

// The candidates whose neighbourhood changed since the last decision take their place in the cost
// order (cost_order.hpp: a key changed many times between two decisions is placed once). The
// placements are the upkeep's work, deferred: their time counts there, not as a step of its own.
void eviction_engine::impl::settle_cost_order_locked() noexcept {
  if (candidates.cost_order_waiting() == 0) return;
  const auto start = std::chrono::steady_clock::now();
  candidates.settle_cost_order();
  stats.upkeep_time_ns +=
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}

void eviction_engine::impl::set_state_locked(buffer_entry& e, buffer_state s) noexcept {
  const bool was_dropped = e.state == buffer_state::dropped;
  e.state = s;
  if (was_dropped == (s == buffer_state::dropped) || !e.in_graph || neighbourhood_lost) return;
  const upkeep_timer timed(stats);
  try {
    if (s == buffer_state::dropped) {
      e.next_read = access.next_read(e.access_key, e.size);
      remove_from_boundaries_locked(e);
      join_class_locked(e);
    } else if (e.cls != nullptr) {
      leave_class_locked(e);
    }
  } catch (...) {
    lose_neighbourhood_locked();
  }
}

void eviction_engine::impl::graph_insert_locked(buffer_entry& e) noexcept {
  if (e.in_graph) return;
  e.in_graph = true;
  e.cls = nullptr;
  set_neighbourhood_locked(e, 0);
  if (neighbourhood_lost) return;
  try {
    if (e.state == buffer_state::dropped) {
      join_class_locked(e);
    } else {
      add_to_boundaries_locked(e);
    }
  } catch (...) {
    lose_neighbourhood_locked();
  }
}

void eviction_engine::impl::graph_remove_locked(buffer_entry& e) noexcept {
  if (!e.in_graph) return;
  if (!neighbourhood_lost) {
    try {
      if (e.cls != nullptr) {
        const upkeep_timer timed(stats);
        leave_class_locked(e);  // now on the boundary of what is left
      }
      remove_from_boundaries_locked(e);
    } catch (...) {
      lose_neighbourhood_locked();
    }
  }
  e.in_graph = false;
  set_neighbourhood_locked(e, 0);
}

// e, not a member and on no boundary, goes on the boundary of each class next to it.
void eviction_engine::impl::add_to_boundaries_locked(buffer_entry& e) {
  const std::uint64_t mark = ++upkeep_mark;
  double cost = 0;
  for_each_neighbour(e, [&](const buffer_entry& m) {
    dtr_class* c = m.cls;
    if (c == nullptr) return;
    if (c->mark != mark) {
      c->boundary.push_back({&e, 0});  // may throw: the caller gives the estimate up
      c->mark = mark;
      cost += c->cost_ns;
    }
    ++c->boundary.back().edges;  // e's entry: nothing else is added to c in this step
  });
  set_neighbourhood_locked(e, cost);
}

// Only the classes on e's consumer side: a dropped buffer upstream of e is rematerialised from its
// own inputs, not from e, so when it is needed says nothing of when e is.
std::uint32_t eviction_engine::impl::dependants_next_read_locked(const buffer_entry& e) const noexcept {
  std::uint32_t earliest = detail::access_profile::no_event;
  for (const node_entry* n : e.consumers) {
    for (const buffer_entry* out : n->outputs) {
      if (out != nullptr && out->cls != nullptr) earliest = std::min(earliest, out->cls->next_read);
    }
  }
  return earliest;
}

// e, not a member, leaves every boundary it is on.
void eviction_engine::impl::remove_from_boundaries_locked(buffer_entry& e) noexcept {
  for_each_neighbour(e, [&](const buffer_entry& m) {
    if (m.cls == nullptr) return;
    dtr_class::neighbour* n = find_neighbour(*m.cls, e);
    if (n != nullptr && --n->edges == 0) erase_neighbour(*m.cls, n);
  });
  set_neighbourhood_locked(e, 0);
}

// t (in the graph, dropped, on no boundary) merges with the classes next to it. Everything that can
// throw happens before the first change.
void eviction_engine::impl::join_class_locked(buffer_entry& t) {
  std::vector<dtr_class*> next;  // the distinct classes next to t
  const std::uint64_t class_mark = ++upkeep_mark;
  for_each_neighbour(t, [&](const buffer_entry& m) {
    if (m.cls != nullptr && m.cls->mark != class_mark) {
      m.cls->mark = class_mark;
      next.push_back(m.cls);
    }
  });
  // Its producer's cost, unless a dropped sibling's class (one of `next`) holds it already.
  const bool holds_cost = t.producer != nullptr && t.producer->cost_holder == nullptr;
  const double own = holds_cost ? t.producer->desc.cost_ns : 0;
  double cost = own;
  std::size_t members = 1;
  std::uint32_t next_read = t.next_read;
  for (const dtr_class* c : next) {
    cost += c->cost_ns;
    members += c->members.size();
    next_read = std::min(next_read, c->next_read);
  }
  // The boundary of the result: the buffers on the old boundaries and t's other neighbours, each
  // once, with its edges summed; scratch_cost is what it was charged for the classes that merge.
  std::vector<dtr_class::neighbour> boundary;
  const std::uint64_t mark = ++upkeep_mark;
  const auto add = [&](buffer_entry& u, std::uint32_t edges, double charged) {
    if (u.mark != mark) {
      u.mark = mark;
      u.scratch_index = static_cast<std::uint32_t>(boundary.size());
      u.scratch_cost = 0;
      boundary.push_back({&u, 0});
    }
    boundary[u.scratch_index].edges += edges;
    u.scratch_cost += charged;
  };
  for (dtr_class* c : next) {
    for (const dtr_class::neighbour& n : c->boundary) {
      if (n.buffer != &t) add(*n.buffer, n.edges, c->cost_ns);  // t left them: never there
    }
  }
  for_each_neighbour(t, [&](buffer_entry& u) {
    if (u.cls == nullptr) add(u, 1, 0);
  });
  dtr_class* into = next.empty() ? make_class_locked()
                                 : *std::max_element(next.begin(), next.end(),
                                                     [](const dtr_class* a, const dtr_class* b) {
                                                       return a->members.size() < b->members.size();
                                                     });
  if (into->members.capacity() < members) {  // geometric, or repeated joins turn quadratic
    into->members.reserve(std::max(members, 2 * into->members.capacity()));
  }

  // No more allocation from here.
  for (dtr_class* c : next) {
    if (c == into) continue;
    for (buffer_entry* m : c->members) {
      m->cls = into;
      m->member_index = static_cast<std::uint32_t>(into->members.size());
      into->members.push_back(m);
    }
    free_class_locked(c);
  }
  t.cls = into;
  t.member_index = static_cast<std::uint32_t>(into->members.size());
  t.member_cost_ns = own;
  if (holds_cost) t.producer->cost_holder = &t;
  into->members.push_back(&t);
  into->cost_ns = cost;
  into->next_read = next_read;
  into->boundary.swap(boundary);
  for (const dtr_class::neighbour& n : into->boundary) {
    buffer_entry& u = *n.buffer;
    set_neighbourhood_locked(u, u.neighbourhood_ns - u.scratch_cost + cost);
  }
  set_neighbourhood_locked(t, 0);
}

// t (a member) leaves its class, which may fall apart, and goes on the boundary of what is left.
void eviction_engine::impl::leave_class_locked(buffer_entry& t) {
  dtr_class* c = t.cls;
  const double old_cost = c->cost_ns;
  buffer_entry* moved = c->members.back();
  c->members[t.member_index] = moved;
  moved->member_index = t.member_index;
  c->members.pop_back();
  t.cls = nullptr;
  // What c stops charging: t's cost, unless a dropped sibling (in c: siblings are adjacent) takes
  // the producer's cost over, since recomputing it still runs the same node.
  double leaving = t.member_cost_ns;
  t.member_cost_ns = 0;
  if (t.producer != nullptr && t.producer->cost_holder == &t) {
    buffer_entry* s = member_sibling(t);
    t.producer->cost_holder = s;
    if (s != nullptr) {
      s->member_cost_ns = leaving;
      leaving = 0;
    }
  }
  c->cost_ns = old_cost - leaving;
  set_neighbourhood_locked(t, 0);

  if (c->members.empty()) {  // t was alone: its neighbours are next to one class fewer
    for (const dtr_class::neighbour& n : c->boundary) {
      set_neighbourhood_locked(*n.buffer, n.buffer->neighbourhood_ns - old_cost);
    }
    free_class_locked(c);
    return;
  }

  std::vector<buffer_entry*> ends;  // t's distinct dropped neighbours: all of them members of c
  const std::uint64_t mark = ++upkeep_mark;
  for_each_neighbour(t, [&](buffer_entry& m) {
    if (m.cls != nullptr && m.mark != mark) {
      m.mark = mark;
      ends.push_back(&m);
    }
  });

  // c without t is still connected when t had one dropped neighbour, or when all of them are
  // outputs of t's producer (adjacent to each other: a path through t goes round it). So a node's
  // outputs brought back one by one never split their class.
  const auto siblings_only = [&] {
    return t.producer != nullptr && std::all_of(ends.begin(), ends.end(), [&](const buffer_entry* m) {
             return m->producer == t.producer;
           });
  };
  if (ends.size() <= 1 || siblings_only()) {
    if (held_earliest(*c, t)) c->next_read = earliest_next_read(*c);
    for_each_neighbour(t, [&](buffer_entry& u) {
      if (u.cls != nullptr) return;
      dtr_class::neighbour* n = find_neighbour(*c, u);
      if (n == nullptr || --n->edges > 0) return;
      set_neighbourhood_locked(u, u.neighbourhood_ns - old_cost);  // its only edge into c was t
      erase_neighbour(*c, n);
    });
    for (const dtr_class::neighbour& n : c->boundary) {
      set_neighbourhood_locked(*n.buffer, n.buffer->neighbourhood_ns - leaving);
    }
    add_to_boundaries_locked(t);
    return;
  }
  split_class_locked(*c, t, ends, old_cost);
}

// c (which t has just left) may have fallen apart: t had two or more dropped neighbours, `ends`.
// One search per end runs in turns, one member each; searches that meet are one; when at most one
// search can still go on, every other one has found a whole component. Those components become
// classes of their own and the rest stays c, so the work is proportional to the parts that move
// out (and their edges), not to c: a long chain of dropped buffers brought back from one end, or
// cut near one end, stays cheap.
void eviction_engine::impl::split_class_locked(dtr_class& c, buffer_entry& t,
                                               const std::vector<buffer_entry*>& ends,
                                               double old_cost) {
  struct search {
    std::vector<buffer_entry*> frontier;
    std::vector<buffer_entry*> seen;
    std::uint32_t group;  // union-find over searches that met
  };
  std::vector<search> searches(ends.size());
  const std::uint64_t mark = ++upkeep_mark;  // members seen by a search: scratch_index = search
  for (std::size_t i = 0; i < ends.size(); ++i) {
    searches[i].frontier.push_back(ends[i]);
    searches[i].seen.push_back(ends[i]);
    searches[i].group = static_cast<std::uint32_t>(i);
    ends[i]->mark = mark;
    ends[i]->scratch_index = static_cast<std::uint32_t>(i);
  }
  const auto group_of = [&](std::uint32_t i) {
    while (searches[i].group != i) i = searches[i].group = searches[searches[i].group].group;
    return i;
  };
  std::size_t running = ends.size();  // groups whose frontier is not empty
  while (running > 1) {
    for (std::uint32_t i = 0; i < searches.size() && running > 1; ++i) {
      if (searches[i].group != i || searches[i].frontier.empty()) continue;
      buffer_entry* m = searches[i].frontier.back();
      searches[i].frontier.pop_back();
      for_each_neighbour(*m, [&](buffer_entry& w) {
        if (w.cls != &c) return;
        if (w.mark != mark) {
          w.mark = mark;
          w.scratch_index = i;
          searches[i].frontier.push_back(&w);
          searches[i].seen.push_back(&w);
          return;
        }
        const std::uint32_t other = group_of(w.scratch_index);
        if (other == i) return;
        // One component: the other search's members and frontier join this one.
        search& o = searches[other];
        if (!o.frontier.empty()) --running;  // the two running groups are one now
        searches[i].frontier.insert(searches[i].frontier.end(), o.frontier.begin(), o.frontier.end());
        searches[i].seen.insert(searches[i].seen.end(), o.seen.begin(), o.seen.end());
        o.frontier.clear();
        o.seen.clear();
        o.group = i;
      });
      if (searches[i].frontier.empty()) --running;
    }
  }
  // Finished searches are whole components; the one still running (or, if none, the largest
  // finished one) is what stays in c.
  std::uint32_t stay = static_cast<std::uint32_t>(searches.size());
  for (std::uint32_t i = 0; i < searches.size(); ++i) {
    if (searches[i].group != i) continue;
    if (!searches[i].frontier.empty()) {
      stay = i;
      break;
    }
    if (stay == searches.size() || searches[i].seen.size() > searches[stay].seen.size()) stay = i;
  }

  // The old boundary, indexed, so that edges into the members that move out can be taken off.
  const std::uint64_t boundary_mark = ++upkeep_mark;
  for (std::uint32_t k = 0; k < c.boundary.size(); ++k) {
    buffer_entry& u = *c.boundary[k].buffer;
    u.mark = boundary_mark;
    u.scratch_index = k;
    set_neighbourhood_locked(u, u.neighbourhood_ns - old_cost);
  }
  const auto take_edge = [&](buffer_entry& u) {
    if (u.mark == boundary_mark) --c.boundary[u.scratch_index].edges;
  };
  for_each_neighbour(t, [&](buffer_entry& u) {
    if (u.cls == nullptr) take_edge(u);  // t is no member any more
  });
  std::vector<dtr_class*> parts;
  bool lost_earliest = held_earliest(c, t);  // then c's is found again below
  for (std::uint32_t i = 0; i < searches.size(); ++i) {
    if (searches[i].group != i || i == stay) continue;
    dtr_class* k = make_class_locked();
    parts.push_back(k);
    k->members.swap(searches[i].seen);
    for (std::uint32_t j = 0; j < k->members.size(); ++j) {
      buffer_entry* m = k->members[j];
      k->next_read = std::min(k->next_read, m->next_read);
      lost_earliest = lost_earliest || held_earliest(c, *m);
      buffer_entry* moved = c.members.back();  // m leaves c.members
      c.members[m->member_index] = moved;
      moved->member_index = m->member_index;
      c.members.pop_back();
      m->cls = k;
      m->member_index = j;
      k->cost_ns += m->member_cost_ns;
      c.cost_ns -= m->member_cost_ns;
      for_each_neighbour(*m, [&](buffer_entry& u) {
        if (u.cls == nullptr && &u != &t) take_edge(u);
      });
    }
  }
  // What stays in c: its boundary without the neighbours that lost every edge into it.
  std::size_t kept = 0;
  for (const dtr_class::neighbour& n : c.boundary) {
    if (n.edges > 0) c.boundary[kept++] = n;
  }
  c.boundary.resize(kept);
  if (c.members.empty()) {  // cannot happen (`stay` holds at least its end), but stay sound
    free_class_locked(&c);
  } else {
    if (lost_earliest) c.next_read = earliest_next_read(c);
    for (const dtr_class::neighbour& n : c.boundary) {
      set_neighbourhood_locked(*n.buffer, n.buffer->neighbourhood_ns + c.cost_ns);
    }
  }
  for (dtr_class* k : parts) {
    const std::uint64_t part_mark = ++upkeep_mark;
    for (const buffer_entry* m : k->members) {
      for_each_neighbour(*m, [&](buffer_entry& u) {
        if (u.cls != nullptr || &u == &t) return;
        if (u.mark != part_mark) {
          u.mark = part_mark;
          u.scratch_index = static_cast<std::uint32_t>(k->boundary.size());
          k->boundary.push_back({&u, 0});
        }
        ++k->boundary[u.scratch_index].edges;
      });
    }
    for (const dtr_class::neighbour& n : k->boundary) {
      set_neighbourhood_locked(*n.buffer, n.buffer->neighbourhood_ns + k->cost_ns);
    }
  }
  // t, no member any more, goes on the boundary of each part next to it (c included).
  add_to_boundaries_locked(t);
}

}  // namespace spillway::eviction
