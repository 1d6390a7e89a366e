// instance_norm_act's problems as its selection tables (selection/norm_tables.cpp) see them: the
// op's checked arguments, made contiguous by the op (ops/instance_norm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "kernels/norm/instance_norm.h"

namespace patchgemm {

struct NormProblem {
  at::Tensor x, weight, bias;  // weight, bias: [C] or undefined
  double eps = 0;
  bool gelu = false;
  NormShape s;
};

struct NormBackwardProblem {
  at::Tensor grad_y, x, weight, bias, mean, rstd;
  bool gelu = false;
  NormShape s;
};

// x's [B, C, S] view (ops/instance_norm.cpp), checking x's rank for `op`.
NormShape norm_shape(const char* op, const at::Tensor& x, bool tokens);

// (y, mean, rstd) and (grad_x, grad_weight, grad_bias) from the implementation the tables pick
// (an affine gradient undefined where there is no weight / bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_instance_norm_act(const NormProblem& p);
std::tuple<at::Tensor, at::Tensor, at::Tensor> select_instance_norm_act_backward(const NormBackwardProblem& p);

}  // namespace patchgemm
