# spillway_torch.cmake: finds the torch Python package that the PyTorch plugin is built against
# and makes spillway::torch_libs, an interface target with its headers and libraries.
#
# The plugin targets the torch its users run (2.11 on the GPU machines). torch's own CMake config
# (TorchConfig.cmake) insists on a matching CUDA toolkit, cuDNN and nvrtc layout; spillway needs
# only headers and five libraries, so it asks the interpreter where they are instead.
#
# In:  SPILLWAY_WITH_TORCH (AUTO | ON | OFF), Python3_EXECUTABLE (the interpreter that has torch;
#      scripts/setup.sh passes .venv/bin/python).
# Out: SPILLWAY_HAVE_TORCH, SPILLWAY_TORCH_VERSION, SPILLWAY_TORCH_DIR, target spillway::torch_libs,
#      SPILLWAY_TORCH_PYTHON_LIB (libtorch_python, for the Python module only).

set(SPILLWAY_HAVE_TORCH OFF)
if(SPILLWAY_WITH_TORCH STREQUAL "OFF")
  return()
endif()

set(_spillway_torch_required "")
if(SPILLWAY_WITH_TORCH STREQUAL "ON")
  set(_spillway_torch_required REQUIRED)
endif()

if(NOT SPILLWAY_HAVE_CUDA)
  if(SPILLWAY_WITH_TORCH STREQUAL "ON")
    message(FATAL_ERROR "spillway: SPILLWAY_WITH_TORCH=ON needs the CUDA toolkit (c10's CUDA headers include it)")
  endif()
  message(STATUS "spillway: PyTorch plugin off (no CUDA toolkit)")
  return()
endif()

find_package(Python3 COMPONENTS Interpreter Development.Module ${_spillway_torch_required})
if(NOT Python3_Interpreter_FOUND OR NOT Python3_Development.Module_FOUND)
  message(STATUS "spillway: PyTorch plugin off (no Python 3 interpreter with development headers)")
  return()
endif()

execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__.split('+')[0]); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  RESULT_VARIABLE _spillway_torch_status
  OUTPUT_VARIABLE _spillway_torch_out
  ERROR_VARIABLE _spillway_torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _spillway_torch_status EQUAL 0)
  if(SPILLWAY_WITH_TORCH STREQUAL "ON")
    message(FATAL_ERROR "spillway: SPILLWAY_WITH_TORCH=ON but ${Python3_EXECUTABLE} cannot import torch:\n${_spillway_torch_err}")
  endif()
  message(STATUS "spillway: PyTorch plugin off (${Python3_EXECUTABLE} cannot import torch)")
  return()
endif()
string(REPLACE "\n" ";" _spillway_torch_out "${_spillway_torch_out}")
list(GET _spillway_torch_out -3 SPILLWAY_TORCH_DIR)
list(GET _spillway_torch_out -2 SPILLWAY_TORCH_VERSION)
list(GET _spillway_torch_out -1 _spillway_torch_abi)

add_library(spillway_torch_libs INTERFACE)
add_library(spillway::torch_libs ALIAS spillway_torch_libs)
target_include_directories(spillway_torch_libs SYSTEM INTERFACE
  ${SPILLWAY_TORCH_DIR}/include ${SPILLWAY_TORCH_DIR}/include/torch/csrc/api/include)
target_compile_definitions(spillway_torch_libs INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${_spillway_torch_abi} USE_C10D_NCCL=0)
foreach(_lib c10 c10_cuda torch_cpu torch_cuda torch)
  find_library(SPILLWAY_TORCH_LIB_${_lib} NAMES ${_lib} PATHS ${SPILLWAY_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(spillway_torch_libs INTERFACE ${SPILLWAY_TORCH_LIB_${_lib}})
endforeach()
target_link_libraries(spillway_torch_libs INTERFACE CUDA::cudart)
# The libraries find their own dependencies (the CUDA runtime wheels) through their RUNPATH; a
# program linked against them needs torch/lib on its own.
target_link_options(spillway_torch_libs INTERFACE "-Wl,-rpath,${SPILLWAY_TORCH_DIR}/lib"
                    "-Wl,--allow-shlib-undefined")

# libtorch_python: only the Python module needs it (at::Tensor <-> torch.Tensor).
find_library(SPILLWAY_TORCH_PYTHON_LIB NAMES torch_python PATHS ${SPILLWAY_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)

set(SPILLWAY_HAVE_TORCH ON)
message(STATUS "spillway: PyTorch plugin against torch ${SPILLWAY_TORCH_VERSION} in ${SPILLWAY_TORCH_DIR}")
if(NOT SPILLWAY_TORCH_VERSION VERSION_EQUAL 2.11.0)
  message(WARNING "spillway: the PyTorch plugin targets torch 2.11; building against ${SPILLWAY_TORCH_VERSION}")
endif()
