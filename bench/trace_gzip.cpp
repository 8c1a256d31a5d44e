// trace_gzip: runs `gzip` with posix_spawnp and pipes. The contract is in trace_gzip.hpp.
#include "trace_gzip.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "spillway/errors.hpp"

extern char** environ;

namespace spillway::trace {
namespace {

// A file descriptor that closes itself.
class fd_guard {
 public:
  explicit fd_guard(int fd = -1) noexcept : fd_(fd) {}
  ~fd_guard() { reset(); }
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  int get() const noexcept { return fd_; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

struct run_result {
  int exit_code = -1;   // -1: killed by a signal
  std::string out;
  std::string err;
};

void read_all(int fd, std::string& into) {
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      into.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0) {
      return;
    } else if (errno != EINTR) {
      throw std::runtime_error(std::string("reading from gzip failed: ") + std::strerror(errno));
    }
  }
}

// Runs argv[0] (found on PATH) with stdout and stderr captured. stderr is read after stdout ends:
// gzip writes at most a line or two there, far below a pipe's capacity, so it never blocks.
run_result run_capture(std::vector<std::string> args) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  fd_guard out_r(out_pipe[0]), out_w(out_pipe[1]);
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  fd_guard err_r(err_pipe[0]), err_w(err_pipe[1]);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_w.get(), 1);
  posix_spawn_file_actions_adddup2(&actions, err_w.get(), 2);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    throw std::runtime_error("cannot run " + args[0] + ": " + std::strerror(rc) +
                             " (gzip is needed for .gz traces)");
  }
  out_w.reset();
  err_w.reset();

  run_result result;
  try {
    read_all(out_r.get(), result.out);
    read_all(err_r.get(), result.err);
  } catch (...) {
    out_r.reset();
    err_r.reset();
    int ignored = 0;
    ::waitpid(pid, &ignored, 0);
    throw;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  while (!result.err.empty() && (result.err.back() == '\n' || result.err.back() == '\r')) {
    result.err.pop_back();
  }
  return result;
}

}  // namespace

bool is_gzip_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw spillway::invalid_argument("cannot open trace file \"" + path + "\": " + std::strerror(errno));
  unsigned char m[2] = {0, 0};
  in.read(reinterpret_cast<char*>(m), 2);
  return in.gcount() == 2 && m[0] == 0x1f && m[1] == 0x8b;
}

std::string gunzip_file(const std::string& path) {
  run_result r = run_capture({"gzip", "-dc", "--", path});
  if (r.exit_code != 0 && r.exit_code != 2) {  // 2: a warning (trailing garbage); the data is whole
    throw spillway::invalid_argument("cannot decompress \"" + path + "\": gzip exited with " +
                                     std::to_string(r.exit_code) + (r.err.empty() ? "" : ": " + r.err));
  }
  return std::move(r.out);
}

void gzip_file_in_place(const std::string& path) {
  const run_result r = run_capture({"gzip", "-n", "-f", "--", path});
  if (r.exit_code != 0) {
    throw std::runtime_error("gzip -n -f \"" + path + "\" exited with " + std::to_string(r.exit_code) +
                             (r.err.empty() ? "" : ": " + r.err));
  }
}

void write_text_file(const std::string& path, const std::string& text, const std::string& what) {
  const bool gz = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  // Compressing: write a temporary file next to the target, gzip it, rename the result, so a
  // half-written file never has the target's name.
  const std::string plain = gz ? path + "." + std::to_string(::getpid()) + ".tmp" : path;
  {
    std::ofstream out(plain, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) throw spillway::invalid_argument("cannot write " + what + " \"" + plain + "\"");
  }
  if (!gz) return;
  try {
    gzip_file_in_place(plain);
  } catch (...) {
    std::remove(plain.c_str());
    throw;
  }
  if (std::rename((plain + ".gz").c_str(), path.c_str()) != 0) {
    std::remove((plain + ".gz").c_str());
    throw spillway::invalid_argument("cannot rename the compressed " + what + " to \"" + path + "\"");
  }
}

}  // namespace spillway::trace
