// instance_norm_act's problems as its selection tables (selection/norm_tables.cpp) see them: the
// op's checked arguments, made contiguous by the op (ops/instance_norm.cpp).
#pragma once

#include <ATen/ATen.h>

namespace patchgemm {

// The [B, S, C] view of x: sizes and the layout flag, shared by the CPU and CUDA paths.
struct NormShape {
  int64_t batch = 0, channels = 0, spatial = 0;
  bool tokens = false;  // channels innermost ([B, S, C]); else [B, C, S]
  C10_HOST_DEVICE int64_t numel() const { return batch * channels * spatial; }
};

// The statistics' dtype: float64 for float64 x, else float32.
inline at::ScalarType norm_acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct NormProblem {
  at::Tensor x, weight, bias;  // weight, bias: [C] or undefined
  double eps = 0;
  bool gelu = false;
  NormShape s;
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)
};

struct NormBackwardProblem {
  at::Tensor grad_y, x, weight, bias, mean, rstd;
  bool gelu = false;
  NormShape s;
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)
};

}  // namespace patchgemm
