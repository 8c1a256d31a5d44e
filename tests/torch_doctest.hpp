// torch_doctest: doctest for tests that use ATen. c10's glog-style CHECK macros
// (c10/util/logging_is_not_google_glog.h, which ATen includes) would shadow doctest's, so ATen
// comes first, those macros go, then doctest. Include this instead of <doctest/doctest.h>, before
// anything else that may include ATen.
#pragma once

#include <ATen/ATen.h>
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
