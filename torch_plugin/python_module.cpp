// python_module.cpp: spillway._C, the native half of the `spillway` Python package
// (torch_plugin/python/spillway). The package's docstrings are the user contract; this is the thin
// layer under them.
//
// - install(conf): builds a torch_allocator from a SPILLWAY_CONF text. With backend "cuda" it
//   becomes PyTorch's CUDA allocator (torch_allocator.hpp); with backend "sim" it is a detached
//   allocator on the simulated device that torch never uses (tests and tools drive it through
//   raw_alloc / raw_free), because no CUDA kernel can run on simulated memory.
// - Errors become Python exceptions by kind: invalid input ValueError (a bad device index given to
//   spillway's own functions, set_budget or stats, included), a bad device index given to torch's
//   allocator interface IndexError, out of memory torch.OutOfMemoryError, an unsupported feature
//   NotImplementedError, anything else RuntimeError. Messages are spillway's, which name the value
//   and what was expected.
// - ActivationManager: activation_manager.hpp for spillway.activations(). Every method releases
//   the GIL before it takes the manager's lock, and replays take it back to run Python: a thread
//   that waits for the lock never holds the GIL, so the two cannot deadlock.
#include <ATen/Functions.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (before pybind11's own)

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "activation_manager.hpp"
#include "byte_size.hpp"
#include "sim_cpu_tensors.hpp"
#include "config_string.hpp"
#include "crash_backtrace.hpp"
#include "spillway/errors.hpp"
#include "torch_allocator.hpp"

namespace py = pybind11;
using namespace spillway;
using spillway::torch_plugin::torch_allocator;

namespace {

// The allocator install() made (installed into torch or detached). Never destroyed: tensors and
// torch's own statics may use it until the process is gone.
std::shared_ptr<torch_allocator>& current = *new std::shared_ptr<torch_allocator>;

torch_allocator& require_installed(const char* caller) {
  if (!current) {
    throw spillway::invalid_argument(std::string("spillway.") + caller +
                                     ": spillway is not installed; call spillway.install() first");
  }
  return *current;
}

torch_plugin::torch_context sim_context() {
  return {[] { return c10::DeviceIndex{0}; }, [](c10::DeviceIndex) { return stream_ref{}; }};
}

py::dict stats_dict(const memory_stats& s) {
  py::dict d;
  const char* type_names[stat_type_count] = {"all", "small_pool", "large_pool"};
  auto put = [&](const char* name, const stat_array& a) {
    for (int t = 0; t < stat_type_count; ++t) {
      const std::string prefix = std::string(name) + "." + type_names[t] + ".";
      d[py::str(prefix + "current")] = a[t].current;
      d[py::str(prefix + "peak")] = a[t].peak;
      d[py::str(prefix + "allocated")] = a[t].allocated;
      d[py::str(prefix + "freed")] = a[t].freed;
    }
  };
  put("allocation", s.allocation);
  put("segment", s.segment);
  put("active", s.active);
  put("inactive_split", s.inactive_split);
  put("allocated_bytes", s.allocated_bytes);
  put("reserved_bytes", s.reserved_bytes);
  put("active_bytes", s.active_bytes);
  put("inactive_split_bytes", s.inactive_split_bytes);
  put("requested_bytes", s.requested_bytes);
  // One stat each, not per pool, as torch.cuda.memory_stats() lists them.
  auto put_one = [&](const std::string& name, const spillway::stat& one) {
    d[py::str(name + ".current")] = one.current;
    d[py::str(name + ".peak")] = one.peak;
    d[py::str(name + ".allocated")] = one.allocated;
    d[py::str(name + ".freed")] = one.freed;
  };
  put_one("oversize_allocations", s.oversize_allocations);
  put_one("oversize_segments", s.oversize_segments);
  d["max_split_size"] = s.max_split_size;
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_sync_all_streams"] = s.num_sync_all_streams;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["num_invalid_frees"] = s.num_invalid_frees;
  d["budget"] = s.budget;
  d["num_pressure_handler_calls"] = s.num_pressure_handler_calls;
  d["pressure_handler_freed_bytes"] = s.pressure_handler_freed_bytes;
  d["num_releases_before_eviction"] = s.num_releases_before_eviction;
  d["num_small_from_large"] = s.num_small_from_large;
  return d;
}

py::object budget_value(std::size_t bytes) {
  return bytes == unlimited_budget ? py::object(py::none()) : py::object(py::int_(bytes));
}

// A Python callable kept by C++: released with the GIL held, whichever thread drops it.
std::shared_ptr<py::function> keep(py::function fn) {
  return std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
}

py::dict activation_dict(const torch_plugin::activation_stats& s) {
  py::dict d;
  for (const auto& [name, value] : s.fields()) d[py::str(name)] = value;
  return d;
}

// A new tensor over `t`'s storage, with the same offset, sizes and strides, that no Python object
// wraps: a tensor a Python object wraps outlives it in C++ (torch preserves the object), and
// its storage then never looks free for the manager to take over (activation_manager::recompute).
at::Tensor cpp_only_alias(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return t;
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

// A saved activation's handle as autograd keeps it. Dropped with the GIL released: releasing the
// handle takes the manager's lock.
struct saved_handle {
  std::shared_ptr<torch_plugin::activation_manager::saved> handle;
  ~saved_handle() {
    if (handle) {
      py::gil_scoped_release no_gil;
      handle.reset();
    }
  }
};

void bind_activation_manager(py::module_& m) {
  using torch_plugin::activation_manager;
  py::class_<saved_handle>(m, "SavedActivation");
  py::class_<activation_manager, std::shared_ptr<activation_manager>>(m, "ActivationManager")
      .def(py::init([](std::optional<std::size_t> max_resident, const std::string& mode,
                       const std::string& policy, std::size_t prefetch, std::size_t min_bytes,
                       std::optional<double> link_bandwidth,
                       std::optional<std::size_t> max_spilled) {
             torch_plugin::activation_options o;
             o.max_resident = max_resident;
             o.mode = torch_plugin::parse_activation_mode(mode);
             o.policy = torch_plugin::parse_activation_policy(policy);
             o.prefetch = prefetch;
             o.min_bytes = min_bytes;
             o.link_bandwidth = link_bandwidth;
             o.max_spilled = max_spilled;
             // With spillway installed, the manager also answers its allocator's pressure.
             return activation_manager::make(o, current ? &current->devices() : nullptr);
           }),
           py::arg("max_resident"), py::arg("mode"), py::arg("policy"), py::arg("prefetch"),
           py::arg("min_bytes"), py::arg("link_bandwidth"), py::arg("max_spilled"))
      .def("pack",
           [](activation_manager& self, const at::Tensor& tensor) -> py::object {
             std::shared_ptr<activation_manager::saved> handle;
             {
               py::gil_scoped_release no_gil;
               handle = self.pack(tensor);
             }
             if (!handle) return py::none();
             // Moved into an instance Python owns: a failure on the way frees it (a raw new
             // would leak, and with it the entry and the manager it holds).
             return py::cast(saved_handle{std::move(handle)});
           })
      .def("unpack",
           [](activation_manager& self, const saved_handle& h) {
             py::gil_scoped_release no_gil;
             return self.unpack(*h.handle);
           })
      .def("begin_segment",
           [](activation_manager& self, py::function replay, std::vector<c10::DeviceIndex> devices,
              std::vector<at::Tensor> inputs) {
             std::shared_ptr<py::function> fn = keep(std::move(replay));
             torch_plugin::segment_replay run = [fn](const std::vector<at::Tensor>& resident,
                                                     std::optional<std::size_t> stop_after) {
               py::gil_scoped_acquire gil;
               torch_plugin::segment_run out;
               {
                 // (saved tensors, output tensors, stopped early)
                 py::tuple got = (*fn)(resident, stop_after);
                 for (py::handle t : got[0]) out.saved.push_back(cpp_only_alias(t.cast<at::Tensor>()));
                 for (py::handle t : got[1]) out.outputs.push_back(cpp_only_alias(t.cast<at::Tensor>()));
                 out.stopped = got[2].cast<bool>();
               }  // the Python tensors go with the tuple: only `out` holds their storages now
               return out;
             };
             py::gil_scoped_release no_gil;
             self.begin_segment(std::move(run), std::move(devices), inputs);
           })
      .def("end_segment", &activation_manager::end_segment, py::arg("host_seconds"),
           py::arg("outputs") = std::vector<at::Tensor>{}, py::call_guard<py::gil_scoped_release>())
      .def("evict",
           [](activation_manager& self, std::size_t bytes) {
             py::gil_scoped_release no_gil;
             return self.evict(bytes);
           })
      .def("end_scope", &activation_manager::end_scope, py::call_guard<py::gil_scoped_release>())
      .def("enforce_max_resident", &activation_manager::enforce_max_resident,
           py::call_guard<py::gil_scoped_release>())
      .def("stats",
           [](activation_manager& self) {
             torch_plugin::activation_stats s;
             {
               py::gil_scoped_release no_gil;
               s = self.stats();
             }
             return activation_dict(s);
           })
      .def("state_of",
           [](activation_manager& self, const at::Tensor& t) {
             py::gil_scoped_release no_gil;
             return self.state_of(t);
           })
      .def("close", &activation_manager::close, py::call_guard<py::gil_scoped_release>());
  m.def("check_activation_policy", [](const std::string& name) {
    (void)torch_plugin::parse_activation_policy(name);  // ValueError naming a bad one
  });
  m.def("activation_totals", [] {
    torch_plugin::activation_stats s;
    {
      py::gil_scoped_release no_gil;
      s = torch_plugin::activation_manager::totals();
    }
    return activation_dict(s);
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "spillway's native module; use the spillway package";
  // Opt-in native stacks on a fatal signal (crash_backtrace.hpp): a job that dies in native code
  // otherwise says nothing about where.
  if (const char* v = std::getenv("SPILLWAY_CRASH_BACKTRACE");
      v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0) {
    (void)torch_plugin::install_crash_backtrace();
  }

  // Exception translation, most specific first, for this module's functions only: a global
  // translator (pybind11 shares them between modules built alike, torch's own included, and
  // tries the last registered first) would turn the c10 errors of every other module's
  // functions into these Python types after `import spillway`.
  // Leaked on purpose: it must not be released after the interpreter has finalised.
  static py::handle torch_oom =
      py::object(py::module_::import("torch").attr("OutOfMemoryError")).release();
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::OutOfMemoryError& e) {
      PyErr_SetString(torch_oom.ptr(), e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const spillway::out_of_memory& e) {
      PyErr_SetString(torch_oom.ptr(), e.what());
    }
  });

  m.def("parse_config",
        [](const std::string& text) {
          const plugin_config c = parse_config(text);
          py::dict d;
          d["budget"] = budget_value(c.allocator.budget);
          d["budget_fraction"] = c.budget_fraction ? py::object(py::float_(*c.budget_fraction)) : py::none();
          d["expandable_segments"] = c.allocator.expandable_segments;
          d["backend"] = c.backend;
          d["policy"] = c.policy;
          d["device"] = c.device ? py::object(py::int_(*c.device)) : py::none();
          d["sim_capacity"] = c.sim_capacity;
          return d;
        },
        py::arg("text"), "Parses a SPILLWAY_CONF text; ValueError names the bad setting.");

  m.def("parse_bytes", [](const std::string& text) { return parse_bytes(text); }, py::arg("text"),
        "Bytes from a size text (\"8GiB\", \"1e9\"); ValueError says what is wrong with it.");

  m.def("install",
        [](const std::string& text) {
          if (current) {
            throw spillway::invalid_argument(
                "spillway.install: spillway is already installed in this process (an allocator "
                "cannot be swapped once tensors may hold its memory)");
          }
          plugin_config config = parse_config(text);
          const bool sim = config.backend == "sim";
          auto allocator = std::make_shared<torch_allocator>(
              std::move(config), sim ? sim_context() : torch_plugin::cuda_context());
          if (!sim) torch_plugin::install(allocator);
          current = std::move(allocator);
        },
        py::arg("conf"));

  m.def("serve_cpu_tensors", [] {
    torch_plugin::serve_cpu_tensors(current);  // invalid_argument: not installed, not sim, twice
  });

  bind_activation_manager(m);

  m.def("is_installed", [] { return current != nullptr; });
  m.def("backend", [] { return require_installed("backend").config().backend; });
  m.def("device_count", [] { return require_installed("device_count").devices().device_count(); });

  // accept_below_live: set even below the memory in use (allocations that need new memory then
  // wait for frees), as a restore must; else a ValueError that leaves the old budget.
  m.def("set_budget",
        [](int device, std::optional<std::size_t> bytes, bool accept_below_live) {
          torch_allocator& a = require_installed("set_budget");
          const budget_report r = a.devices().device(device).set_budget(
              bytes.value_or(unlimited_budget),
              accept_below_live ? below_live::accept : below_live::refuse);
          py::dict d;
          d["budget"] = budget_value(r.budget);
          d["reserved"] = r.reserved;
          d["released"] = r.released;
          d["shortfall"] = r.shortfall;
          return d;
        },
        py::arg("device"), py::arg("bytes"), py::arg("accept_below_live") = false);

  m.def("get_budget", [](int device) {
    return budget_value(require_installed("get_budget").devices().device(device).budget());
  });

  m.def("stats", [](int device) {
    torch_allocator& a = require_installed("stats");
    py::gil_scoped_release no_gil;  // stats() takes the device lock
    memory_stats s = a.device_stats(device);
    py::gil_scoped_acquire gil;
    return stats_dict(s);
  });

  m.def("empty_cache", [] {
    torch_allocator& a = require_installed("empty_cache");
    py::gil_scoped_release no_gil;
    return a.devices().empty_cache();
  });

  // Raw device memory, for tests and tools on the simulated device.
  m.def("raw_alloc",
        [](std::size_t bytes, int device) {
          torch_allocator& a = require_installed("raw_alloc");
          py::gil_scoped_release no_gil;  // the pressure path may call back into Python
          return reinterpret_cast<std::uintptr_t>(a.devices().allocate(device, bytes, stream_ref{}));
        },
        py::arg("bytes"), py::arg("device") = 0);
  m.def("raw_free", [](std::uintptr_t ptr) {
    torch_allocator& a = require_installed("raw_free");
    py::gil_scoped_release no_gil;
    return a.release(reinterpret_cast<void*>(ptr)) != free_result::foreign;
  });
}
