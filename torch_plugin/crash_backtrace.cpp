// crash_backtrace.cpp: see crash_backtrace.hpp.
#include "crash_backtrace.hpp"

#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace spillway::torch_plugin {
namespace {

constexpr int k_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int k_signal_count = sizeof(k_signals) / sizeof(k_signals[0]);
struct sigaction previous[k_signal_count];
std::atomic<bool> installed{false};
alignas(16) char alternate_stack[1 << 16];

void write_text(const char* s) noexcept {
  const std::size_t n = std::strlen(s);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t w = ::write(STDERR_FILENO, s + done, n - done);
    if (w <= 0) return;
    done += static_cast<std::size_t>(w);
  }
}

// Digits of v in `base` into buf (no allocation); returns buf.
const char* format_number(std::uintptr_t v, unsigned base, char (&buf)[32]) noexcept {
  char* p = buf + sizeof buf - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v % base];
    v /= base;
  } while (v != 0 && p > buf);
  return p;
}

void on_fatal_signal(int sig, siginfo_t* info, void*) {
  char number[32];
  write_text("spillway: fatal signal ");
  write_text(format_number(static_cast<std::uintptr_t>(sig), 10, number));
  write_text(" (fault address 0x");
  write_text(format_number(reinterpret_cast<std::uintptr_t>(info ? info->si_addr : nullptr), 16, number));
  write_text(") on thread ");
  write_text(format_number(static_cast<std::uintptr_t>(::syscall(SYS_gettid)), 10, number));
  write_text("; native stack:\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  // Put back what was there and let it run: a fault recurs when this returns; a signal sent by
  // raise() or abort() (si_code <= 0) does not, so it is sent again.
  for (int i = 0; i < k_signal_count; ++i) {
    if (k_signals[i] == sig) ::sigaction(sig, &previous[i], nullptr);
  }
  if (info == nullptr || info->si_code <= 0) ::raise(sig);
}

}  // namespace

bool install_crash_backtrace() noexcept {
  if (installed.exchange(true)) return false;
  void* warm[1];
  (void)::backtrace(warm, 1);  // loads the unwinder now: its first call may allocate
  stack_t alt{};
  alt.ss_sp = alternate_stack;
  alt.ss_size = sizeof alternate_stack;
  (void)::sigaltstack(&alt, nullptr);  // without it the handler runs on the faulting stack
  struct sigaction action {};
  action.sa_sigaction = &on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  bool ok = true;
  for (int i = 0; i < k_signal_count; ++i) {
    if (::sigaction(k_signals[i], &action, &previous[i]) != 0) ok = false;
  }
  return ok;
}

}  // namespace spillway::torch_plugin
