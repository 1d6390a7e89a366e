// The instance_norm_act selection table's entry points (norm_tables.cpp):
// the implementation each call runs.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "problems/norm.h"

namespace patchgemm {

// (y, mean, rstd) and (grad_x, grad_weight, grad_bias) from the implementation the tables pick
// (an affine gradient undefined where there is no weight / bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_instance_norm_act(const NormProblem& p);
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_instance_norm_act_backward(const NormBackwardProblem& p);

}  // namespace patchgemm
