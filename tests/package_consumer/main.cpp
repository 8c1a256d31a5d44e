// Allocates through an installed spillway on the simulated device; exits 0 when it works.
#include <spillway/device_allocator.hpp>
#include <spillway/sim_device.hpp>

#include <cstdio>
#include <memory>

int main() {
  auto device = std::make_shared<spillway::sim_device>();
  spillway::device_allocator alloc(device);
  void* p = alloc.allocate(1000);
  const bool ok = alloc.owns(p) && alloc.stats().allocated_bytes[0].current == 1024;
  alloc.deallocate(p);
  std::puts(ok ? "consumer: ok" : "consumer: unexpected statistics");
  return ok ? 0 : 1;
}
