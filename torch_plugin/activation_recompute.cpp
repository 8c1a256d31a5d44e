// activation_recompute.cpp: checkpoint segments (their lineage, generator states and measured
// cost) and the replay that refills their dropped storages. Contract: activation_manager.hpp.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "activation_manager_impl.hpp"
#include "spillway/errors.hpp"

namespace spillway::torch_plugin {

using detail::byte_view;

detail::generator_states detail::generator_states::capture(
    const std::vector<c10::DeviceIndex>& devices) {
  generator_states s;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard lock(gen.mutex());
    s.cpu = gen.get_state();
  }
  for (c10::DeviceIndex d : devices) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(d);
    std::lock_guard lock(gen.mutex());
    s.cuda.emplace_back(d, gen.get_state());
  }
  return s;
}

void detail::generator_states::apply() const {
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard lock(gen.mutex());
    gen.set_state(cpu);
  }
  for (const auto& [d, state] : cuda) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(d);
    std::lock_guard lock(gen.mutex());
    gen.set_state(state);
  }
}

namespace {

// The storages of `tensors` that nothing else holds: neither another tensor (a storage's use
// count is its tensors') nor another handle of one of these tensors.
std::unordered_set<c10::StorageImpl*> held_only_by(const std::vector<at::Tensor>& tensors) {
  std::unordered_map<c10::TensorImpl*, std::size_t> handles;  // of each tensor, in `tensors`
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.has_storage()) ++handles[t.unsafeGetTensorImpl()];
  }
  std::unordered_map<c10::StorageImpl*, std::size_t> tensors_of;  // distinct, in `tensors`
  std::unordered_set<c10::StorageImpl*> held_elsewhere;
  for (const auto& [impl, count] : handles) {
    c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
    ++tensors_of[storage];
    if (c10::raw::intrusive_ptr::use_count(impl) != count) held_elsewhere.insert(storage);
  }
  std::unordered_set<c10::StorageImpl*> only;
  for (const auto& [storage, count] : tensors_of) {
    if (held_elsewhere.count(storage) == 0 && c10::raw::intrusive_ptr::use_count(storage) == count) {
      only.insert(storage);
    }
  }
  return only;
}

}  // namespace

namespace {
// Replays nested in one another on one thread (an input evicted again before its replay took it):
// past this, a runaway (each level is a native and, from Python, an interpreter stack of frames).
constexpr int max_replay_depth = 64;
}  // namespace

activation_manager::segment* activation_manager::dropped_producer(const segment_input& in) {
  const bool dropped = in.held && in.held->entry_->state == entry_state::dropped;
  return dropped ? in.held->entry_->lineage.get() : nullptr;
}

// Made resident again: copied back if spilled; if dropped, recomputed by its segment, after the
// earlier segments whose outputs that segment's replay needs and which were dropped too, and
// theirs in turn. A frame per segment being made ready to replay gathers its inputs, each made
// resident and then held (so that nothing evicts it before the replay runs); an input that is
// dropped pushes a frame for the segment that returned it, and is looked at again once that
// segment has been replayed. So a long chain of dropped checkpoints, or a segment fed by many
// (skip connections, dense blocks), is a loop, not a deep recursion. Two rules keep it linear
// and its memory small:
// - every output a replay restores that a frame on the stack reads later, or that a segment
//   such a frame will replay first reads, is held for that frame until its own replay (the
//   pressure of any unpack in between would evict it, and its segment would be replayed again,
//   and the chain below it: exponentially, for segments of two outputs);
// - a frame gathers its dropped inputs first, the dearest to replay first (segment_cost), and
//   the resident or spilled ones last: what it holds while it descends into a long chain is then
//   little (a ladder's short side input is restored after its long chain, not held through it).
// A replay nests another only when it reads, itself, a dropped storage that is not its input.
void activation_manager::make_resident(entry& e) {
  if (e.state == entry_state::spilled) {
    copy_in(e);
    return;
  }
  if (e.state != entry_state::dropped) return;
  struct frame {
    segment* s;
    std::vector<std::size_t> order;  // its inputs' indices, in the order they are gathered
    std::size_t next = 0;            // into order
    std::vector<at::Tensor> inputs;  // by index, as they are gathered
    std::vector<at::Tensor> held;    // its later inputs, restored by replays on the way
    bool replayed_producer = false;  // order[next]'s segment has just been replayed
  };
  const auto frame_for = [&](segment* s) {
    frame f{s, {}, 0, std::vector<at::Tensor>(s->inputs.size()), {}, false};
    std::vector<std::pair<double, std::size_t>> keyed;  // (-cost, index): dearest first
    for (std::size_t i = 0; i < s->inputs.size(); ++i) {
      segment* producer = dropped_producer(s->inputs[i]);
      keyed.emplace_back(producer ? -segment_cost(*producer, /*depth=*/8) : 1.0, i);
    }
    std::stable_sort(keyed.begin(), keyed.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [key, i] : keyed) f.order.push_back(i);
    return f;
  };
  std::vector<frame> stack;
  stack.push_back(frame_for(e.lineage.get()));
  std::unordered_set<const segment*> on_stack{e.lineage.get()};
  // The outputs `ready` restored that a frame on the stack reads later, or that a segment it
  // will replay first reads (one reached from its inputs through dropped producers, not on the
  // stack): held by that frame until its own replay. Each such segment is charged to the
  // topmost frame that reaches it, the first to run after it. Holding only what the frames read
  // themselves let go of an output that a frame pushed later reads; the pressure of any unpack
  // in between dropped it, and `ready` was replayed twice in one restore.
  const auto hold_for_frames_below = [](std::vector<frame>& frames,
                                        const std::unordered_set<const segment*>& pushed,
                                        const segment& ready) {
    std::unordered_set<const segment*> reached;  // off the stack: frames on it gather their own
    std::vector<const segment*> walk;
    for (auto g = frames.rbegin(); g != frames.rend(); ++g) {
      const auto look_at = [&](const segment_input& in) {
        if (in.held && in.held->entry_->lineage.get() == &ready &&
            in.held->entry_->state == entry_state::resident) {
          g->held.push_back(in.held->alias_.detach());
        }
        segment* producer = dropped_producer(in);
        if (producer != nullptr && pushed.count(producer) == 0 && reached.insert(producer).second) {
          walk.push_back(producer);
        }
      };
      for (std::size_t j = g->next; j < g->order.size(); ++j) look_at(g->s->inputs[g->order[j]]);
      while (!walk.empty()) {
        const segment* reader = walk.back();
        walk.pop_back();
        for (const segment_input& in : reader->inputs) look_at(in);
      }
    }
  };
  while (!stack.empty()) {
    frame& f = stack.back();
    if (f.next == f.order.size()) {  // ready: replayed, then the frames below go on
      segment* ready = f.s;
      std::vector<at::Tensor> inputs = std::move(f.inputs);
      const std::vector<at::Tensor> held = std::move(f.held);  // let go once it has run
      on_stack.erase(ready);
      stack.pop_back();
      // Only the last replay may stop early: one below it on the stack can be waiting for any
      // of this one's outputs or saves, and one dropped past a stop would not come back.
      recompute(*ready, ready != e.lineage.get() || replay_depth_ > 0, std::move(inputs),
                /*may_stop=*/stack.empty());
      hold_for_frames_below(stack, on_stack, *ready);
      continue;
    }
    const std::size_t index = f.order[f.next];
    const segment_input& in = f.s->inputs[index];
    if (segment* producer = dropped_producer(in)) {
      if (f.replayed_producer) {
        throw std::runtime_error("spillway: recomputing a checkpoint segment did not restore its "
                                 "output of " + std::to_string(in.held->entry_->nbytes) +
                                 " bytes, another segment's input (it is not deterministic)");
      }
      f.replayed_producer = true;
      // Lineage runs back in time (an input is held before its segment begins, and a new entry's
      // lineage is a segment open already), so this cannot happen; were it to, it is an error,
      // not a hang.
      if (!on_stack.insert(producer).second) {
        throw std::runtime_error("spillway: a checkpoint segment's lineage is cyclic: its replay "
                                 "needs its own output");
      }
      stack.push_back(frame_for(producer));  // `f` is not used after this
      continue;
    }
    f.inputs[index] = in.held ? read_for_replay(*in.held) : in.kept;  // a spilled one is copied back
    ++f.next;
    f.replayed_producer = false;
  }
  if (e.state != entry_state::resident) {
    throw std::runtime_error("spillway: recomputing a checkpoint segment did not restore an "
                             "activation of " + std::to_string(e.nbytes) +
                             " bytes (the segment saved fewer tensors the second time: it is "
                             "not deterministic)");
  }
}

void activation_manager::recompute(segment& s, bool nested, std::vector<at::Tensor> inputs,
                                   bool may_stop) {
  // Bounds any recursion: a replay that reads other segments' dropped storages itself.
  if (replay_depth_ >= max_replay_depth) {
    throw std::runtime_error("spillway: recomputing a checkpoint segment needs replays nested " +
                             std::to_string(replay_depth_ + 1) + " deep, over the limit of " +
                             std::to_string(max_replay_depth) +
                             " (its inputs were evicted again and again while they were "
                             "restored, or its replay reads dropped storages of other segments "
                             "that are not its inputs)");
  }
  struct depth_guard {
    int& depth;
    explicit depth_guard(int& d) : depth(d) { ++depth; }
    ~depth_guard() { --depth; }
  } nesting{replay_depth_};
  if (!inputs_unchanged(s)) {  // after its storages were dropped (droppable checks it before)
    throw std::runtime_error("spillway: a checkpoint segment's input was modified in place after "
                             "the segment ran and its activations were dropped: they cannot be "
                             "recomputed (the replay would start from other bytes)");
  }
  // What it saved, then what it returned: the entries a replay refills, in the order it gives
  // them. A storage that is gone has no entry. One that lives may have been let go and
  // registered again since, a new entry with other bytes: a save's entry is the one it saved
  // (its seq), an output's one whose lineage is this segment.
  const auto entry_of = [this](const c10::weak_intrusive_ptr<c10::StorageImpl>& weak) -> entry* {
    if (c10::intrusive_ptr<c10::StorageImpl> storage = weak.lock()) {
      auto it = entries_.find(storage.get());
      if (it != entries_.end()) return it->second.get();
    }
    return nullptr;
  };
  std::vector<entry*> members;
  for (const auto& saved : s.saved) {
    entry* e = saved ? entry_of(saved->storage) : nullptr;
    members.push_back(e != nullptr && e->seq == saved->seq ? e : nullptr);
  }
  for (const auto& output : s.outputs) {
    entry* e = output.first ? entry_of(*output.first) : nullptr;
    members.push_back(e != nullptr && e->lineage.get() == &s ? e : nullptr);
  }
  std::vector<entry*> refilled;  // pinned until the end: the refill's allocations may evict
  refilled.reserve(members.size());  // first: once users are counted, nothing may throw before
                                     // the guard below exists
  for (entry* e : members) {
    if (e) ++e->users;
  }
  struct release_members {
    activation_manager& self;
    std::vector<entry*>& members;
    std::vector<entry*>& refilled;
    ~release_members() {
      for (entry* e : refilled) --e->pins;
      for (entry*& e : members) {
        if (e && --e->users == 0 && e->orphaned) {
          self.forget(*e);
          e = nullptr;
        }
      }
    }
  } release_guard{*this, members, refilled};

  const std::optional<std::size_t> stop_after =
      may_stop ? early_stop(s, members) : std::nullopt;
  std::vector<at::Tensor> fresh;
  std::size_t given = members.size();  // the members the replay gave back
  bool stopped = false;
  {
    const detail::generator_states current = detail::generator_states::capture(s.cuda_devices);
    struct put_back {
      const detail::generator_states& states;
      ~put_back() { states.apply(); }
    } restore_guard{current};
    s.rng.apply();
    segment_run run = s.replay(inputs, stop_after);
    // Aligned with `members`: a replay that saved fewer or more tensors than the first run
    // is caught below by a size, or by the entry it leaves dropped (make_resident).
    if (run.stopped) {
      stopped = true;
      given = std::min(run.saved.size(), s.saved.size());
      run.outputs.clear();
    }
    fresh = std::move(run.saved);
    fresh.resize(s.saved.size());
    run.outputs.resize(s.outputs.size());
    fresh.insert(fresh.end(), run.outputs.begin(), run.outputs.end());
  }
  inputs.clear();  // held no more: an input the replay saved again is then the replay's alone
  // What is refilled: the members dropped now that the replay gave back. One dropped later, by
  // the pressure of the refill's own allocations, or past where a stopped replay stopped, stays
  // dropped (restored when it is used), as its size was not checked. Check every size first, so
  // that a failing replay changes nothing.
  std::vector<bool> to_refill(members.size(), false);
  for (std::size_t i = 0; i < given && i < fresh.size(); ++i) {
    entry* e = members[i];
    to_refill[i] = e != nullptr && !e->orphaned && e->state == entry_state::dropped;
  }
  for (std::size_t i = 0; i < members.size() && i < fresh.size(); ++i) {
    entry* e = members[i];
    if (!to_refill[i]) continue;
    const std::size_t got = fresh[i].defined() && fresh[i].has_storage() ? fresh[i].storage().nbytes() : 0;
    if (got != e->nbytes) {
      throw std::runtime_error("spillway: recomputing a checkpoint segment gave a storage of " +
                               std::to_string(got) + " bytes where the original had " +
                               std::to_string(e->nbytes) + ": the segment is not deterministic");
    }
  }
  // A fresh storage that only `fresh` holds gives its memory to the entry: no allocation and no
  // copy, so that a replay needs the segment's bytes once, not twice. One that something else
  // holds too (the segment's input, saved again) is copied, and so is one whose memory another
  // entry took already (a replay that aliases what the first run did not): from that entry.
  const std::unordered_set<c10::StorageImpl*> only_in_fresh = held_only_by(fresh);
  std::unordered_map<c10::StorageImpl*, entry*> taken_by;
  for (std::size_t i = 0; i < members.size() && i < fresh.size(); ++i) {
    entry* e = members[i];
    // Dropped since, by the pressure of this loop's copies: not checked, so left dropped. And one
    // refilled already through another index (a storage saved twice) is not refilled again.
    if (!to_refill[i] || e->orphaned || e->state != entry_state::dropped) continue;
    // What may throw comes before the memory is the entry's, or takes it back: should host
    // memory run out here, the entry is dropped as it was, holding nothing.
    c10::StorageImpl* source = fresh[i].storage().unsafeGetStorageImpl();
    const auto taken = taken_by.find(source);
    if (taken == taken_by.end() && only_in_fresh.count(source) > 0 &&
        source->device() == e->device) {
      taken_by.emplace(source, e);
      e->storage.set_data_ptr_noswap(source->set_data_ptr(at::DataPtr(nullptr, source->device())));
      source->set_nbytes(0);
      ++counters_.recompute_moves;
    } else {
      const c10::Storage& from = taken == taken_by.end() ? fresh[i].storage() : taken->second->storage;
      {
        const c10::OptionalDeviceGuard on_its_device(e->device);  // allocators serve the current one
        e->storage.set_data_ptr_noswap(e->storage.allocator()->allocate(e->nbytes));
      }
      // Its size before the view: a view past a storage's size resizes it (a second allocation).
      e->storage.set_nbytes(e->nbytes);
      try {
        byte_view(e->storage, e->nbytes).copy_(byte_view(from, e->nbytes));
      } catch (...) {
        e->storage.set_data_ptr_noswap(at::DataPtr(nullptr, e->device));
        e->storage.set_nbytes(0);  // dropped, as it was
        throw;
      }
    }
    e->storage.set_nbytes(e->nbytes);
    if (e->device.is_cuda()) {
      // Its block and bytes were made on this thread's stream (the replay's tensor taken over, or
      // a block allocated there and the refill's copy): a spill waits for that stream; a reader
      // on another stream waits for the event, as for a copy back, and is recorded on the block
      // (wait_for_copy_back), so its free waits for that reader too.
      const c10::Stream made_on = c10::cuda::getCurrentCUDAStream(e->device.index()).unwrap();
      try {
        c10::Event done(c10::DeviceType::CUDA);
        done.record(made_on);
        e->copy = std::move(done);
      } catch (...) {
        e->storage.set_data_ptr_noswap(at::DataPtr(nullptr, e->device));
        e->storage.set_nbytes(0);  // dropped, as it was
        throw;
      }
      e->saved_on = made_on;
      e->allocated_on = made_on;
    }
    e->state = entry_state::resident;
    e->last_use = detail::now_seconds();  // made now, as a copy back's is: not the stalest victim
    became_resident(*e);
    ++e->pins;
    refilled.push_back(e);
  }
  ++counters_.recomputes;
  if (nested) ++counters_.nested_recomputes;
  if (stopped) ++counters_.recomputes_stopped;
}

// Where a replay of `s` may stop (segment_replay): after its last save that is dropped and
// still used, when none of its outputs is dropped (outputs come at the end of a run); nullopt:
// it runs to the end. `members`: its saves, then its outputs, as recompute lists them. Under
// torch.utils.checkpoint's early stop too, what backward has consumed already (the saves of the
// segment's last operations, for one whose first operations' saves were dropped) is not
// recomputed.
std::optional<std::size_t> activation_manager::early_stop(const segment& s,
                                                          const std::vector<entry*>& members) {
  std::size_t last_wanted = 0;  // one past the last save to give back
  for (std::size_t i = 0; i < members.size(); ++i) {
    const entry* e = members[i];
    if (e == nullptr || e->orphaned || e->state != entry_state::dropped) continue;
    if (i >= s.saved.size()) return std::nullopt;  // an output
    last_wanted = i + 1;
  }
  if (last_wanted == 0 || last_wanted == s.saved.size()) return std::nullopt;
  return last_wanted;
}

// Every input still has the version it had when the segment began: a replay starts from the
// same bytes.
bool activation_manager::inputs_unchanged(const segment& s) const {
  for (const segment_input& in : s.inputs) {
    const at::Tensor& t = in.held ? in.held->alias_ : in.kept;  // the alias shares the counter
    if (t.defined() && detail::version_of(t) != in.version) {
      return false;
    }
  }
  return true;
}

// A replay's cost: the segment's measured forward time (on CUDA its device time, once the end
// event has completed; the host's before) plus the segments that would have to be replayed first
// for its dropped inputs, `depth` of them back at most.
double activation_manager::segment_cost(segment& s, int depth) {
  // The segment, and each distinct dropped segment its replay needs first (make_resident replays
  // each once), up to `depth` inputs back: a set, not a tree, so that a segment fed by many
  // dropped ones (a dense block) costs a sum, not a number of paths that grows as a power.
  std::vector<std::pair<segment*, int>> frontier{{&s, 0}};  // a FIFO queue: nearest first, so
  std::unordered_set<const segment*> seen{&s};              // each is reached at its own depth
  double cost = 0;
  for (std::size_t next = 0; next < frontier.size(); ++next) {
    const auto [t, level] = frontier[next];
    cost += measured_cost(*t);
    if (level == depth) continue;
    for (const segment_input& in : t->inputs) {
      segment* producer = dropped_producer(in);
      if (producer != nullptr && seen.insert(producer).second) {
        frontier.emplace_back(producer, level + 1);
      }
    }
  }
  return cost;
}

double activation_manager::measured_cost(segment& s) {
  if (s.end && s.end->query()) {
    s.cost_s = s.start->elapsedTime(*s.end) / 1e3;
    s.start.reset();
    s.end.reset();
  }
  // Still running (a storage evicted during its forward): the time it has run so far, a lower
  // bound, rather than nothing, which would make every drop look free.
  return s.ended ? s.cost_s : detail::now_seconds() - s.began_s;
}

// --- segments ---------------------------------------------------------------------------------------

void activation_manager::begin_segment(segment_replay replay,
                                       std::vector<c10::DeviceIndex> cuda_devices,
                                       const std::vector<at::Tensor>& inputs) {
  std::lock_guard lock(mutex_);
  auto s = std::make_shared<segment>();
  s->began_s = detail::now_seconds();
  // Held before the segment opens, so none takes this segment as lineage (see hold).
  for (const at::Tensor& t : inputs) {
    segment_input in;
    in.held = hold(t, /*saved_by_autograd=*/false);
    if (!in.held) in.kept = t;
    in.version = detail::version_of(t);
    s->inputs.push_back(std::move(in));
  }
  s->replay = std::move(replay);
  s->rng = detail::generator_states::capture(cuda_devices);
  if (!cuda_devices.empty()) {
    s->start.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    s->start->record(c10::cuda::getCurrentCUDAStream(cuda_devices.front()).unwrap());
  }
  s->cuda_devices = std::move(cuda_devices);
  segments_by_thread_[std::this_thread::get_id()].open.push_back(std::move(s));
}

void activation_manager::end_segment(double host_seconds, const std::vector<at::Tensor>& outputs) {
  std::lock_guard lock(mutex_);
  thread_segments* t = this_thread_segments();
  if (t == nullptr || t->open.empty()) {
    throw invalid_argument("spillway: end_segment without begin_segment on this thread");
  }
  // Closed first: whatever throws below, no later save takes an open segment for lineage.
  std::shared_ptr<segment> s = std::move(t->open.back());
  t->open.pop_back();
  s->cost_s = host_seconds;
  if (s->start) {
    s->end.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    s->end->record(c10::cuda::getCurrentCUDAStream(s->cuda_devices.front()).unwrap());
  }
  s->replayable = inputs_unchanged(*s);
  // Its saved storages' bytes are, from now on, what its replay gives back; none, if it cannot
  // replay (one dropped already makes its replay fail clearly: see recompute).
  for (const auto& saved : s->saved) {
    if (!saved) continue;
    if (c10::intrusive_ptr<c10::StorageImpl> storage = saved->storage.lock()) {
      auto it = entries_.find(storage.get());
      if (it != entries_.end() && it->second->lineage == s) {
        it->second->lineage_version =
            s->replayable ? detail::version_of(it->second->version) : std::nullopt;
      }
    }
  }
  s->ended = true;
  for (const at::Tensor& t : outputs) {
    const std::optional<std::uint32_t> version = detail::version_of(t);
    if (version && t.has_storage()) {
      s->outputs.emplace_back(t.storage().getWeakStorageImpl(), *version);
    } else {
      s->outputs.emplace_back(std::nullopt, 0);  // no storage, or no version to check it by
    }
  }
  std::shared_ptr<segment> previous = std::exchange(t->last_ended, std::move(s));
  settle_last_ended();  // none of its outputs may be left to register
  // `previous` goes last, after the walk (releasing it may come back to settle_last_ended).
}

}  // namespace spillway::torch_plugin
