// The grouped linear selection table's entry points (grouped_linear_tables.cpp):
// the implementation each call runs.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "problems/grouped_linear.h"

namespace patchgemm {

// Runs the problem's GEMM with the implementation its table picks; returns out.
at::Tensor select_grouped_gemm(const GroupedProblem& p);

}  // namespace patchgemm
