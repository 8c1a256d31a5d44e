# spillway_cxx_runtime.cmake: finds out whether the C++ compiler links its runtime (libstdc++)
# into what it builds statically, as a toolchain configured so or -static-libstdc++ in LDFLAGS
# does. spillway's Python module and plugin libraries are loaded into processes that already have
# a shared libstdc++ (python, libtorch): Note [One C++ runtime per symbol] in docs/integration.md.
#
# Out: SPILLWAY_STATIC_CXX_RUNTIME (ON when the probe's executable defines libstdc++'s
#      std::locale::classic() itself), and a warning naming the compiler when it is ON.

set(_probe_dir ${CMAKE_BINARY_DIR}/CMakeFiles/spillway_cxx_runtime)
set(_probe_src ${_probe_dir}/probe.cpp)
set(_probe_bin ${_probe_dir}/probe${CMAKE_EXECUTABLE_SUFFIX})
file(WRITE ${_probe_src} "#include <locale>\nint main() { return std::locale::classic().name().empty(); }\n")
try_compile(_probe_built ${_probe_dir}/build SOURCES ${_probe_src} COPY_FILE ${_probe_bin}
            OUTPUT_VARIABLE _probe_output)

set(SPILLWAY_STATIC_CXX_RUNTIME OFF)
if(NOT _probe_built)
  message(WARNING "spillway: could not link a probe program to tell how ${CMAKE_CXX_COMPILER} "
                  "links its C++ runtime; assuming a shared libstdc++")
elseif(NOT CMAKE_NM)
  message(WARNING "spillway: no nm to tell how ${CMAKE_CXX_COMPILER} links its C++ runtime; "
                  "assuming a shared one")
else()
  execute_process(COMMAND ${CMAKE_NM} --defined-only ${_probe_bin}
                  OUTPUT_VARIABLE _probe_symbols ERROR_QUIET RESULT_VARIABLE _probe_nm)
  # Defined in the program: the runtime was copied into it (libstdc++'s or libc++'s mangling). A
  # shared one leaves it undefined.
  if(_probe_nm EQUAL 0 AND _probe_symbols MATCHES "_ZNSt(3__1)?6locale7classicEv")
    set(SPILLWAY_STATIC_CXX_RUNTIME ON)
  endif()
endif()
unset(_probe_built CACHE)  # try_compile caches it: probe again at every configure

if(SPILLWAY_STATIC_CXX_RUNTIME)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _shared_runtime OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  message(WARNING
    "spillway: ${CMAKE_CXX_COMPILER} links libstdc++ statically (its shared libstdc++: "
    "'${_shared_runtime}'; linker flags: '${CMAKE_EXE_LINKER_FLAGS}'). spillway's Python module "
    "and plugin libraries keep their copy private (version scripts), but a C++ exception thrown "
    "by spillway into PyTorch then crosses two C++ runtimes, and programs linked with LibTorch "
    "(the test_libtorch_* tests) hold two copies that the dynamic linker mixes, and may fail. "
    "Prefer a compiler whose libstdc++ is shared, as PyTorch's process loads it (for example "
    "CXX=/usr/bin/g++).")
endif()
message(STATUS "spillway: C++ runtime linked statically: ${SPILLWAY_STATIC_CXX_RUNTIME}")
