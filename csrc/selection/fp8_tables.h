// The FP8 selection table's entry points (fp8_tables.cpp): the implementation each call runs.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "problems/fp8.h"

namespace patchgemm {

QuantizeOutputs select_quantize_fp8(const QuantizeProblem& p);
at::Tensor select_scaled_grouped_mm(const ScaledGroupedProblem& p);
at::Tensor select_scaled_ragged_mm(const ScaledRaggedProblem& p);

}  // namespace patchgemm
