// The grouped pointwise conv selection table's entry points (grouped_pointwise_conv_tables.cpp):
// the implementation each call runs.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "problems/grouped_pointwise_conv.h"

namespace patchgemm {

// Fills p.out and returns it, or returns a result of its own of shape out_sizes (any format).
at::Tensor select_grouped_pointwise_conv(const GroupedPointwiseConvProblem& p);
// (grad_w, grad_b): grad_b undefined without with_bias.
std::tuple<at::Tensor, at::Tensor> select_grouped_pointwise_conv_weight_grad(
    const GroupedPointwiseConvWeightGradProblem& p);

}  // namespace patchgemm
