// Catch2 for tests that include LibTorch. c10 defines a glog-style CHECK macro that would replace
// Catch's (aborting the run instead of reporting a failure); including ATen first and dropping that
// macro before Catch defines its own keeps Catch's. Include this first, instead of <catch2/catch.hpp>.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#undef CHECK
#include <catch2/catch.hpp>
