// forwarding_backend: a device_backend that hands every call to another one (usually the sim),
// with a hook around each call: a test overrides before() to fail chosen calls, or before() and
// after() to change what holds while the backend runs.
//
//   struct failing_waits final : forwarding_backend {
//     using forwarding_backend::forwarding_backend;
//     bool armed = false;
//     void before(backend_call c) override {
//       if (armed && c == backend_call::stream_wait_event) throw device_error("injected");
//     }
//   };
//
// before() may throw: the call is then not made. after() runs when the call returns or throws,
// only if before() returned.
#pragma once

#include <memory>
#include <string>
#include <type_traits>

#include "spillway/device_backend.hpp"

namespace spillway::test {

enum class backend_call {
  name, total_memory, free_memory, reserve_segment, release_segment, synchronize_device,
  reserve_address_range, release_address_range, map_physical, unmap_physical, create_stream,
  destroy_stream, synchronize_stream, create_event, destroy_event, record_event, event_completed,
  synchronize_event, stream_wait_event, copy_async, allocate_pinned_host, free_pinned_host,
};

class forwarding_backend : public device_backend {
 public:
  explicit forwarding_backend(std::shared_ptr<device_backend> inner) : inner_(std::move(inner)) {}

  int device_index() const noexcept override { return inner_->device_index(); }
  std::size_t vmm_granularity() const noexcept override { return inner_->vmm_granularity(); }
  std::string name() const override {
    return call(backend_call::name, [&] { return inner_->name(); });
  }
  std::size_t total_memory() const override {
    return call(backend_call::total_memory, [&] { return inner_->total_memory(); });
  }
  std::size_t free_memory() const override {
    return call(backend_call::free_memory, [&] { return inner_->free_memory(); });
  }
  void* reserve_segment(std::size_t b) override {
    return call(backend_call::reserve_segment, [&] { return inner_->reserve_segment(b); });
  }
  void release_segment(void* p, std::size_t b) noexcept override {
    quiet(backend_call::release_segment, [&] { inner_->release_segment(p, b); });
  }
  void synchronize_device() override {
    call(backend_call::synchronize_device, [&] { inner_->synchronize_device(); });
  }
  void* reserve_address_range(std::size_t b) override {
    return call(backend_call::reserve_address_range,
                [&] { return inner_->reserve_address_range(b); });
  }
  void release_address_range(void* p, std::size_t b) noexcept override {
    quiet(backend_call::release_address_range, [&] { inner_->release_address_range(p, b); });
  }
  bool map_physical(void* p, std::size_t b) override {
    return call(backend_call::map_physical, [&] { return inner_->map_physical(p, b); });
  }
  void unmap_physical(void* p, std::size_t b) noexcept override {
    quiet(backend_call::unmap_physical, [&] { inner_->unmap_physical(p, b); });
  }
  stream_ref create_stream() override {
    return call(backend_call::create_stream, [&] { return inner_->create_stream(); });
  }
  void destroy_stream(stream_ref s) noexcept override {
    quiet(backend_call::destroy_stream, [&] { inner_->destroy_stream(s); });
  }
  void synchronize_stream(stream_ref s) override {
    call(backend_call::synchronize_stream, [&] { inner_->synchronize_stream(s); });
  }
  event_ref create_event() override {
    return call(backend_call::create_event, [&] { return inner_->create_event(); });
  }
  void destroy_event(event_ref e) noexcept override {
    quiet(backend_call::destroy_event, [&] { inner_->destroy_event(e); });
  }
  void record_event(event_ref e, stream_ref s) override {
    call(backend_call::record_event, [&] { inner_->record_event(e, s); });
  }
  bool event_completed(event_ref e) override {
    return call(backend_call::event_completed, [&] { return inner_->event_completed(e); });
  }
  void synchronize_event(event_ref e) override {
    call(backend_call::synchronize_event, [&] { inner_->synchronize_event(e); });
  }
  void stream_wait_event(stream_ref s, event_ref e) override {
    call(backend_call::stream_wait_event, [&] { inner_->stream_wait_event(s, e); });
  }
  void copy_async(void* d, const void* s, std::size_t b, copy_kind k, stream_ref st) override {
    call(backend_call::copy_async, [&] { inner_->copy_async(d, s, b, k, st); });
  }
  void* allocate_pinned_host(std::size_t b) override {
    return call(backend_call::allocate_pinned_host,
                [&] { return inner_->allocate_pinned_host(b); });
  }
  void free_pinned_host(void* p, std::size_t b) noexcept override {
    quiet(backend_call::free_pinned_host, [&] { inner_->free_pinned_host(p, b); });
  }

 protected:
  virtual void before(backend_call) {}
  virtual void after() noexcept {}

 private:
  template <class F>
  std::invoke_result_t<F> call(backend_call c, F&& f) const {
    auto& self = const_cast<forwarding_backend&>(*this);
    self.before(c);
    struct done {
      forwarding_backend& b;
      ~done() { b.after(); }
    } d{self};
    return f();
  }
  // The noexcept calls: before() may not fail them.
  template <class F>
  void quiet(backend_call c, F&& f) noexcept {
    try {
      before(c);
    } catch (...) {
    }
    f();
    after();
  }

  std::shared_ptr<device_backend> inner_;
};

}  // namespace spillway::test
