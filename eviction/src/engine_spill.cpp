// engine_spill.cpp: spilling to pinned host memory and restoring, in stream order.
//
// Note [Spill and restore stream order] (docs/eviction.md), in short:
//   spill    event A on the buffer's stream -> d2h stream waits A -> copy to host -> event S on
//            d2h; the device block is record_stream'ed onto d2h and freed, so the allocator reuses
//            it only after S (no device synchronisation).
//   restore  new block on the buffer's stream; h2d stream waits S -> copy to device -> event R on
//            h2d; the buffer's stream waits R; the host block returns to the pool after R.
#include <algorithm>

#include "engine_impl.hpp"

namespace spillway::eviction {

using detail::buffer_entry;

event_ref eviction_engine::impl::take_event_locked() {
  if (idle_events.empty()) return backend.create_event();
  const event_ref e = idle_events.back();
  idle_events.pop_back();
  return e;
}

void eviction_engine::impl::give_event_locked(event_ref e) noexcept {
  try {
    idle_events.push_back(e);
  } catch (...) {
    backend.destroy_event(e);
  }
}

// `waiter` will not run past this point before the work already queued on `producer` is done.
void eviction_engine::impl::order_after_locked(stream_ref waiter, stream_ref producer) {
  const event_ref e = take_event_locked();
  try {
    backend.record_event(e, producer);
    backend.stream_wait_event(waiter, e);
  } catch (...) {
    give_event_locked(e);
    throw;
  }
  give_event_locked(e);  // re-recording later is fine: the wait captured this recording
}

// Returns false, changing nothing, when the spill cannot be done (no pinned memory, a copy fault).
bool eviction_engine::impl::spill_locked(buffer_entry& e) {
  void* host_block = host.allocate(e.size);
  if (host_block == nullptr) {
    ++stats.host_allocation_failures;
    return false;
  }
  event_ref done{};
  bool copy_queued = false;
  try {
    order_after_locked(d2h_stream, e.stream);  // the copy reads what e.stream wrote
    for (stream_ref s : e.use_streams) order_after_locked(d2h_stream, s);  // and pin(id, use)
    backend.copy_async(host_block, e.device_ptr, e.size, copy_kind::device_to_host, d2h_stream);
    copy_queued = true;
    done = take_event_locked();
    backend.record_event(done, d2h_stream);
    allocator.record_stream(e.device_ptr, d2h_stream);
    reserve_one_more(in_flight);
  } catch (const std::exception&) {
    // Nothing was freed: the buffer stays resident. A copy already queued only reads the block,
    // which stays allocated, but writes the host block: that goes back to the pool once the d2h
    // stream has drained. If it cannot be drained, the block stays handed out (the pool frees it
    // when destroyed) rather than go to another spill, or back to the backend, under the copy.
    if (done.value != 0) give_event_locked(done);
    bool host_block_free = true;
    if (copy_queued) {
      try {
        backend.synchronize_stream(d2h_stream);
      } catch (...) {
        host_block_free = false;
      }
    }
    if (host_block_free) {
      try {
        host.free(host_block);
      } catch (...) {
        // Out of host memory for the pool's lists: the block stays handed out as well. A spill
        // that could not start returns false, never throws: under pressure the allocator would
        // take an exception for "nothing freed" this round.
      }
    }
    return false;
  }
  by_pointer.erase(e.device_ptr);
  allocator.deallocate(e.device_ptr);  // deferred until `done`: see Note [Cross-stream frees]
  e.device_ptr = nullptr;
  e.use_streams.clear();
  e.host_ptr = host_block;
  e.spill_done = done;
  e.state = buffer_state::spilling;
  in_flight.push_back(&e);
  d2h_queued_bytes += e.size;
  ++stats.spills;
  stats.bytes_spilled += e.size;
  return true;
}

// Makes a spilled (or spilling) buffer resident again, in stream order on its stream. Throws with
// the buffer spilled (or spilling) as it was: its host copy, its events and by_pointer unchanged.
void eviction_engine::impl::restore_locked(buffer_entry& e) {
  // The allocation may call the pressure handler back on this thread, whose reap moves e from
  // spilling to spilled if its copy has completed: e keeps its state until the block is there.
  void* block = allocate_locked(e.size, e.stream);
  e.state = buffer_state::restoring;  // not a candidate while its new block is being filled
  event_ref ready{};
  event_ref host_done{};
  try {
    ready = take_event_locked();
    host_done = take_event_locked();
    if (e.spill_done.value != 0) backend.stream_wait_event(h2d_stream, e.spill_done);
    order_after_locked(h2d_stream, e.stream);  // the block may have been used before on e.stream
    backend.copy_async(block, e.host_ptr, e.size, copy_kind::host_to_device, h2d_stream);
    backend.record_event(ready, h2d_stream);
    backend.stream_wait_event(e.stream, ready);
    by_pointer.emplace(block, &e);
    reserve_one_more(in_flight);
  } catch (...) {
    if (ready.value != 0) give_event_locked(ready);
    if (host_done.value != 0) give_event_locked(host_done);
    by_pointer.erase(block);
    // The copy may be queued and still write the block: its free waits for the h2d stream (an
    // event the allocator records, or a wait for the stream), else the block is leaked.
    try {
      allocator.record_stream(block, h2d_stream);
      allocator.deallocate(block);
    } catch (...) {  // out of host memory for the block's list of streams
      try {
        backend.synchronize_stream(h2d_stream);
        allocator.deallocate(block);
      } catch (...) {
      }
    }
    e.state = e.spill_done.value != 0 ? buffer_state::spilling : buffer_state::spilled;
    throw;
  }
  // The host copy returns to the pool once the copy that reads it has completed.
  try {
    backend.record_event(host_done, h2d_stream);
    host.free_after(e.host_ptr, host_done);
  } catch (...) {
    give_event_locked(host_done);
    try {
      backend.synchronize_stream(h2d_stream);
      host.free(e.host_ptr);
    } catch (...) {
    }
  }
  if (e.spill_done.value != 0) {  // restored while spilling: the copy out still runs
    detach_d2h_copy_locked(e.spill_done, e.size);
    e.spill_done = {};
    std::erase(in_flight, &e);
  }
  e.host_ptr = nullptr;
  e.device_ptr = block;
  note_block_locked(e);
  e.ready = ready;
  in_flight.push_back(&e);
  ++stats.restores;
  stats.bytes_restored += e.size;
}

// `s` uses e's block from now on, besides e.stream: it waits for e.stream's work, the block is not
// reused before the work queued on `s` has run (record_stream), and a spill copies only after it.
void eviction_engine::impl::use_on_stream_locked(buffer_entry& e, stream_ref s) {
  if (s == e.stream) return;
  order_after_locked(s, e.stream);
  allocator.record_stream(e.device_ptr, s);
  if (std::find(e.use_streams.begin(), e.use_streams.end(), s) == e.use_streams.end()) {
    e.use_streams.push_back(s);
  }
}

// Moves buffers whose copies have completed on: spilling -> spilled, restoring -> resident.
void eviction_engine::impl::reap_in_flight_locked() {
  for (std::size_t i = 0; i < in_flight.size();) {
    buffer_entry& e = *in_flight[i];
    const bool spilling = e.state == buffer_state::spilling;
    const event_ref ev = spilling ? e.spill_done : e.ready;
    if (!backend.event_completed(ev)) {
      ++i;
      continue;
    }
    give_event_locked(ev);
    if (spilling) {
      e.spill_done = {};
      e.state = buffer_state::spilled;
      d2h_queued_bytes -= e.size;
    } else {
      e.ready = {};
      e.state = buffer_state::resident;
      update_candidacy_locked(e);
    }
    in_flight[i] = in_flight.back();
    in_flight.pop_back();
  }
  for (std::size_t i = 0; i < detached_d2h.size();) {
    const detached_copy c = detached_d2h[i];
    if (!backend.event_completed(c.done)) {
      ++i;
      continue;
    }
    give_event_locked(c.done);
    d2h_queued_bytes -= c.bytes;
    detached_d2h[i] = detached_d2h.back();
    detached_d2h.pop_back();
  }
}

void eviction_engine::impl::detach_d2h_copy_locked(event_ref done, std::size_t bytes) noexcept {
  try {
    reserve_one_more(detached_d2h);
    if (done.value == 0) {
      const event_ref marker = take_event_locked();
      try {
        backend.record_event(marker, d2h_stream);
      } catch (...) {
        give_event_locked(marker);
        throw;
      }
      done = marker;
    }
    detached_d2h.push_back({done, bytes});  // reserved: does not throw
  } catch (...) {  // out of host memory, or no event: the estimate lets the bytes go now
    if (done.value != 0) give_event_locked(done);
    d2h_queued_bytes -= bytes;
  }
}

// Drops the host copy of a buffer: now if no copy touches it, after the spill's copy otherwise.
// The spill's bookkeeping (its event, in_flight, the d2h queue) goes first, so that whatever the
// pool does, the buffer is left without a host copy and consistent.
void eviction_engine::impl::discard_host_copy_locked(buffer_entry& e) noexcept {
  if (e.host_ptr == nullptr) return;
  void* const block = e.host_ptr;
  const event_ref done = e.spill_done;
  e.host_ptr = nullptr;
  if (done.value != 0) {
    detach_d2h_copy_locked({}, e.size);  // `done` goes to the host pool below
    e.spill_done = {};
    std::erase(in_flight, &e);
  }
  if (e.state == buffer_state::spilling || e.state == buffer_state::spilled) {
    set_state_locked(e, buffer_state::dropped);
  }
  try {
    if (done.value != 0) {
      host.free_after(block, done);  // the pool owns the event now
    } else {
      host.free(block);
    }
    return;
  } catch (...) {
    // Out of host memory for the pool's lists (an unknown pointer cannot happen).
  }
  if (done.value == 0) return;  // the block stays handed out: the pool frees it when destroyed
  try {
    backend.synchronize_event(done);  // the copy into the block has completed: free it now
  } catch (...) {
    return;  // the copy may still write the block: the event and the block are leaked
  }
  backend.destroy_event(done);
  try {
    host.free(block);
  } catch (...) {
  }
}

}  // namespace spillway::eviction
