# check_exports.cmake: a library spillway loads into other programs exports only its entry points
# (Note [One C++ runtime per symbol] in docs/integration.md). Run by ctest:
#
#   cmake -DNM=<nm> -DLIBRARY=<file> -DALLOWED=<regex> -P check_exports.cmake
#
# Fails naming every exported symbol that ALLOWED does not match (a C++ runtime that a toolchain
# linked in statically, or any C++ symbol, would be bound by the dynamic linker to the process's
# other copy), and when nothing at all is exported (the check would prove nothing).
cmake_minimum_required(VERSION 3.21)
foreach(var NM LIBRARY ALLOWED)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "check_exports.cmake: -D${var}=... is required")
  endif()
endforeach()
execute_process(COMMAND ${NM} -D --defined-only ${LIBRARY}
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_exports.cmake: ${NM} -D ${LIBRARY} failed (${rc}): ${errors}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(exported 0)
set(unexpected "")
foreach(line IN LISTS lines)
  # "<address> <type> <name>[@version]"; absolute symbols (type A) are version nodes.
  if(NOT line MATCHES "^[0-9a-fA-F]+ ([A-Za-z]) ([^@ ]+)")
    continue()
  endif()
  if(CMAKE_MATCH_1 STREQUAL "A")
    continue()
  endif()
  set(name "${CMAKE_MATCH_2}")  # a failed MATCHES below clears CMAKE_MATCH_<n>
  math(EXPR exported "${exported} + 1")
  if(NOT name MATCHES "${ALLOWED}")
    list(APPEND unexpected "${name}")
  endif()
endforeach()
if(exported EQUAL 0)
  message(FATAL_ERROR "${LIBRARY} exports nothing; expected symbols matching '${ALLOWED}'")
endif()
if(unexpected)
  list(LENGTH unexpected n)
  list(SUBLIST unexpected 0 20 shown)
  string(REPLACE ";" "\n  " shown "${shown}")
  message(FATAL_ERROR "${LIBRARY} exports ${n} symbols that '${ALLOWED}' does not allow, "
                      "among them:\n  ${shown}")
endif()
message(STATUS "${LIBRARY}: ${exported} exported symbols, all matching '${ALLOWED}'")
