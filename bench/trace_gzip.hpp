// trace_gzip: gzip for trace files, through the `gzip` program.
//
// Why a program and not zlib: the tools then need no compression library at build time (the GPU
// machines that run bench/gpu_suite.sh are offline and carry only Boost and doctest headers), and
// a trace is read once per run, so starting one process costs nothing measurable. `gzip` is on every Linux system (and in
// scripts/setup.sh). No shell is involved: the program is started with posix_spawnp and an argv,
// so file names are never interpreted.
//
// Contract
// - is_gzip_file(path): the file starts with the gzip magic bytes (1f 8b). Throws
//   spillway::invalid_argument when the file cannot be opened.
// - gunzip_file(path): the decompressed bytes. A corrupt or truncated file throws
//   spillway::invalid_argument with gzip's own message; a missing gzip program throws
//   std::runtime_error.
// - gzip_file_in_place(path): replaces `path` by `path`.gz (gzip -n: no name or time stamp in the
//   output, so the same trace always compresses to the same bytes).
// - write_text_file(path, text, what): writes `text`, gzipped when `path` ends in .gz. A compressed
//   file is written to a temporary name and renamed, so a half-written file never has `path`.
//   Failures throw spillway::invalid_argument naming `what` and the path.
#pragma once

#include <string>

namespace spillway::trace {

bool is_gzip_file(const std::string& path);
std::string gunzip_file(const std::string& path);
void gzip_file_in_place(const std::string& path);
void write_text_file(const std::string& path, const std::string& text, const std::string& what);

}  // namespace spillway::trace
