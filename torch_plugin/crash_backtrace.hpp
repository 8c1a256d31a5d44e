// crash_backtrace: on a fatal signal, the native stack of the thread that got it, on stderr.
//
// A PyTorch job that dies of SIGSEGV inside native code prints nothing by itself, and Python's
// faulthandler shows only the Python frames above it. install_crash_backtrace() adds, for
// SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT, a handler that writes
//   spillway: fatal signal N (fault address 0x...) on thread T; native stack:
// then one line per frame (backtrace_symbols_fd: module+offset, and the symbol where it is
// exported), puts back the handler that was there before (Python's faulthandler, or the default)
// and returns, so the fault happens again and that handler runs too (a signal sent by raise() or
// abort() is raised again instead).
//
// Contract
// - Opt-in: the spillway Python module calls it at import when SPILLWAY_CRASH_BACKTRACE is set to
//   a non-empty value other than 0 (bench/train_bench.py and tests/torch_gpu_checks.py set it for
//   their workers). Once per process; later calls do nothing.
// - The handler runs on an alternate signal stack on the thread that installed it, so a stack
//   overflow there is reported too; other threads run it on their own stack (an overflow there
//   ends without the report).
// - It writes with write(2) only, after backtrace() has been called once at install (its first
//   call may allocate); it is meant for a process that is about to die, not to recover.
#pragma once

namespace spillway::torch_plugin {

// Installs the handlers; returns false if the process has them already (or sigaction failed).
bool install_crash_backtrace() noexcept;

}  // namespace spillway::torch_plugin
