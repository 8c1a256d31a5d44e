// deadlock_watchdog: aborts the test process, naming what hung, if it is not destroyed within its
// limit. A test of lock discipline would otherwise hang until CTest's timeout, saying nothing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace spillway::test {

class deadlock_watchdog {
 public:
  explicit deadlock_watchdog(const char* what,
                             std::chrono::seconds limit = std::chrono::seconds(60))
      : what_(what) {
    thread_ = std::thread([this, limit] {
      std::unique_lock lock(mutex_);
      if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
        std::fprintf(stderr, "deadlock: %s did not finish within %lld s\n", what_,
                     static_cast<long long>(limit.count()));
        std::abort();
      }
    });
  }
  ~deadlock_watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  deadlock_watchdog(const deadlock_watchdog&) = delete;
  deadlock_watchdog& operator=(const deadlock_watchdog&) = delete;

 private:
  const char* what_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace spillway::test
