// stress_report.cpp: the final summary of spillway-stress, as a table and as JSON.
#include "stress_report.hpp"

#include <cstdio>

#include "bench_common.hpp"
#include "spillway/errors.hpp"

namespace spillway::bench {
namespace {

constexpr int agg = static_cast<int>(stat_type::aggregate);

std::string count_text(std::uint64_t n) {  // 1234567 -> "1,234,567"
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string bytes_text(std::int64_t n) {
  std::string text = format_bytes(static_cast<std::size_t>(n < 0 ? -n : n));
  if (n < 0) text.insert(text.begin(), '-');  // (not "-" + text: GCC 12 warns falsely there)
  return text;
}

std::string fixed(double v, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, v);
  return text;
}

void row(std::ostream& out, const std::string& name, const std::string& value) {
  out << "  " << name << std::string(name.size() < 26 ? 26 - name.size() : 1, ' ') << value << '\n';
}

void stat_row(std::ostream& out, const std::string& name, const stat& s, bool bytes) {
  auto v = [&](std::int64_t n) { return bytes ? bytes_text(n) : count_text(static_cast<std::uint64_t>(n)); };
  row(out, name, "current " + v(s.current) + ", peak " + v(s.peak) + ", total " + v(s.allocated));
}

void stat_json(json_writer& j, const std::string& name, const stat& s) {
  j.key(name).begin_object();
  j.field("current", s.current).field("peak", s.peak).field("allocated", s.allocated);
  j.field("freed", s.freed);
  j.end_object();
}

}  // namespace

double stress_report::fragmentation() const noexcept {
  const auto allocated = stats.allocated_bytes[agg].peak;
  return allocated > 0 ? static_cast<double>(stats.reserved_bytes[agg].peak) / allocated : 0;
}

void judge(stress_report& r) {
  auto fail = [&](std::string why) { r.failures.push_back(std::move(why)); };
  if (r.corruptions() > 0) {
    fail(count_text(r.corruptions()) + " corrupted allocation(s) (" +
         count_text(r.counts.corruptions) + " at free, " + count_text(r.async_corruptions) +
         " found by stream work)");
  }
  if (r.counts.bad_frees > 0) {
    fail(count_text(r.counts.bad_frees) + " free(s) of live allocations were refused as not live");
  }
  if (!r.error.empty()) fail("a worker stopped: " + r.error);
  if (r.counts.allocs != r.counts.frees) {
    fail(count_text(r.counts.allocs) + " allocations but " + count_text(r.counts.frees) + " frees");
  }
  const memory_stats& s = r.stats;
  if (s.allocated_bytes[agg].current != 0 || s.allocation[agg].current != 0) {
    fail("after every free the allocator still counts " +
         count_text(static_cast<std::uint64_t>(s.allocation[agg].current)) + " allocation(s), " +
         bytes_text(s.allocated_bytes[agg].current) + " allocated");
  }
  const memory_stats& e = r.after_release;
  if (e.active_bytes[agg].current != 0) {
    fail("after all stream work and empty_cache, " + bytes_text(e.active_bytes[agg].current) +
         " are still active (frees waiting on events that should have completed)");
  }
  if (r.budget != unlimited_budget && static_cast<std::size_t>(s.reserved_bytes[agg].peak) > r.budget) {
    fail("peak reserved " + bytes_text(s.reserved_bytes[agg].peak) + " is over the budget " +
         format_bytes(r.budget));
  }
  if (e.reserved_bytes[agg].current != 0) {
    fail("empty_cache left " + bytes_text(e.reserved_bytes[agg].current) + " reserved in " +
         count_text(static_cast<std::uint64_t>(e.segment[agg].current)) + " segment(s)");
  }
}

void print_table(std::ostream& out, const stress_report& r) {
  const memory_stats& s = r.stats;
  out << "spillway-stress on " << r.device_name << " (" << r.device_why << ")\n";
  out << "  " << r.threads << " threads, " << r.streams << " streams, budget "
      << format_bytes(r.budget) << ", sizes up to " << format_bytes(r.max_size) << ", seed "
      << r.seed << (r.expandable ? ", expandable segments" : "") << ", lifetimes x"
      << fixed(r.lifetime_scale, 2) << '\n';
  out << "  checks: " << r.work << "\n\n";
  row(out, "elapsed", fixed(r.elapsed_s, 2) + " s");
  row(out, "ops", count_text(r.counts.ops));
  row(out, "ops/s", count_text(static_cast<std::uint64_t>(r.ops_per_second())));
  row(out, "allocs", count_text(r.counts.allocs) + " (" + format_bytes(r.counts.bytes_allocated) +
                         " requested in all)");
  row(out, "frees", count_text(r.counts.frees) + " (" + count_text(r.counts.cross_thread_frees) +
                        " cross-thread, " + count_text(r.counts.deferred_frees) +
                        " deferred on events)");
  row(out, "record_stream calls", count_text(r.counts.record_streams));
  row(out, "stream work items", count_text(r.kernels));
  row(out, "OOMs", count_text(r.counts.ooms));
  row(out, "corruptions", count_text(r.corruptions()) + " (" + count_text(r.counts.checks) +
                              " checked at free, " + count_text(r.async_checks) +
                              " by stream work)");
  row(out, "peak allocated", bytes_text(s.allocated_bytes[agg].peak));
  row(out, "peak reserved", bytes_text(s.reserved_bytes[agg].peak));
  row(out, "fragmentation", fixed(r.fragmentation(), 3) +
                                " (peak reserved / peak allocated: two peaks, maybe not at one moment)");
  row(out, "alloc retries", count_text(static_cast<std::uint64_t>(s.num_alloc_retries)));
  row(out, "segments", "peak " + count_text(static_cast<std::uint64_t>(s.segment[agg].peak)) +
                           ", device allocs " +
                           count_text(static_cast<std::uint64_t>(s.num_device_alloc)) +
                           ", device frees " +
                           count_text(static_cast<std::uint64_t>(s.num_device_free)));
  row(out, "alloc latency", "(calls, out of memory included) p50 " + count_text(r.latency.p50_ns) +
                                " ns, p90 " +
                                count_text(r.latency.p90_ns) + " ns, p99 " +
                                count_text(r.latency.p99_ns) + " ns, p99.9 " +
                                count_text(r.latency.p999_ns) + " ns, max " +
                                count_text(r.latency.max_ns) + " ns (" +
                                count_text(r.latency.samples) + " samples)");
  out << "\n  allocator stats (aggregate pool)\n";
  stat_row(out, "allocation", s.allocation[agg], false);
  stat_row(out, "allocated_bytes", s.allocated_bytes[agg], true);
  stat_row(out, "requested_bytes", s.requested_bytes[agg], true);
  stat_row(out, "active_bytes", s.active_bytes[agg], true);
  stat_row(out, "reserved_bytes", s.reserved_bytes[agg], true);
  stat_row(out, "segment", s.segment[agg], false);
  stat_row(out, "inactive_split_bytes", s.inactive_split_bytes[agg], true);
  row(out, "num_ooms", count_text(static_cast<std::uint64_t>(s.num_ooms)));
  row(out, "num_sync_all_streams", count_text(static_cast<std::uint64_t>(s.num_sync_all_streams)));
  row(out, "num_invalid_frees", count_text(static_cast<std::uint64_t>(s.num_invalid_frees)));
  row(out, "reserved after empty", bytes_text(r.after_release.reserved_bytes[agg].current));
  row(out, "warnings", count_text(r.warnings));
  out << '\n';
  if (r.passed()) {
    out << "PASSED\n";
  } else {
    out << "FAILED\n";
    for (const auto& f : r.failures) out << "  - " << f << '\n';
  }
}

void print_json(std::ostream& out, const stress_report& r) {
  const memory_stats& s = r.stats;
  json_writer j(out);
  j.begin_object();
  j.field("tool", "spillway-stress");
  j.field("device", r.device_kind).field("device_name", r.device_name);
  j.field("device_why", r.device_why).field("checks_by", r.work);
  j.field("threads", r.threads).field("streams", static_cast<std::uint64_t>(r.streams));
  j.field("seconds_requested", r.seconds).field("ops_requested", r.ops);
  j.field("budget", static_cast<std::uint64_t>(r.budget));
  j.field("max_size", static_cast<std::uint64_t>(r.max_size));
  j.field("seed", r.seed).field("expandable", r.expandable);
  j.field("lifetime_scale", r.lifetime_scale);
  j.field("elapsed_s", r.elapsed_s);
  j.field("ops", r.counts.ops).field("ops_per_s", r.ops_per_second());
  j.field("allocs", r.counts.allocs).field("frees", r.counts.frees);
  j.field("bytes_requested", r.counts.bytes_allocated);
  j.field("cross_thread_frees", r.counts.cross_thread_frees);
  j.field("deferred_frees", r.counts.deferred_frees);
  j.field("record_streams", r.counts.record_streams);
  j.field("stream_work_items", r.kernels);
  j.field("ooms", r.counts.ooms);
  j.field("corruptions", r.corruptions());
  j.field("checks_at_free", r.counts.checks).field("checks_by_stream_work", r.async_checks);
  j.field("peak_allocated", s.allocated_bytes[agg].peak);
  j.field("peak_reserved", s.reserved_bytes[agg].peak);
  j.field("fragmentation", r.fragmentation());
  j.field("alloc_retries", s.num_alloc_retries);
  j.field("segments_peak", s.segment[agg].peak);
  j.field("device_allocs", s.num_device_alloc).field("device_frees", s.num_device_free);
  j.key("alloc_latency_ns").begin_object();
  j.field("samples", r.latency.samples).field("p50", r.latency.p50_ns);
  j.field("p90", r.latency.p90_ns).field("p99", r.latency.p99_ns);
  j.field("p999", r.latency.p999_ns).field("max", r.latency.max_ns);
  j.end_object();
  j.key("allocator_stats").begin_object();
  stat_json(j, "allocation", s.allocation[agg]);
  stat_json(j, "allocated_bytes", s.allocated_bytes[agg]);
  stat_json(j, "requested_bytes", s.requested_bytes[agg]);
  stat_json(j, "active_bytes", s.active_bytes[agg]);
  stat_json(j, "reserved_bytes", s.reserved_bytes[agg]);
  stat_json(j, "segment", s.segment[agg]);
  stat_json(j, "inactive_split_bytes", s.inactive_split_bytes[agg]);
  j.field("num_alloc_retries", s.num_alloc_retries).field("num_ooms", s.num_ooms);
  j.field("num_sync_all_streams", s.num_sync_all_streams);
  j.field("num_device_alloc", s.num_device_alloc).field("num_device_free", s.num_device_free);
  j.field("num_invalid_frees", s.num_invalid_frees);
  j.end_object();
  j.field("reserved_after_empty_cache", r.after_release.reserved_bytes[agg].current);
  j.field("warnings", r.warnings);
  j.field("error", r.error);
  j.key("failures").begin_array();
  for (const auto& f : r.failures) j.value(f);
  j.end_array();
  j.field("passed", r.passed());
  j.end_object();
  out << '\n';
}

}  // namespace spillway::bench
