// Instance norm fused with GELU, the glue between the stages of a hierarchical stem
// (Conv -> InstanceNorm -> GELU -> Conv ...). Unfused, PyTorch makes five passes over the largest
// activation of the stem forward and saves two copies of it for backward; fused, the forward makes
// two passes (statistics, then normalize + activate) and saves only its input, and the backward
// makes two (per-channel sums, then the input gradient) recomputing the activation's input.
//
// x is one of two layouts of [B, C, S] (S = the flattened spatial or token dims):
//   channels-first [B, C, *spatial] (a conv's output), or tokens [B, S, C] (channels innermost).
// Statistics are per (sample, channel) over S, in float32 (float64 for float64 input).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "problems/norm.h"

namespace patchgemm {

// The ATen implementation (instance_norm_aten.cpp), any device; x, weight, bias contiguous (weight,
// bias [C] or undefined). Forward: (y, mean, rstd). Backward: (grad_x, grad_weight, grad_bias), the
// affine gradients [C] in x's dtype, undefined where there is no weight / bias.
std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_aten(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps, bool gelu,
    const NormShape& s);
std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_backward_aten(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool gelu, const NormShape& s);

// The same through ATen's batch norm over x as [1, B * C, S] (how ATen's instance_norm runs it) and
// ATen's GELU: PyTorch's own kernels and accumulation, one pass each; the CPU's path. The backward
// recomputes the norm's output for GELU's gradient from the statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_batch_norm(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps, bool gelu,
    const NormShape& s);
std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_backward_batch_norm(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool gelu, const NormShape& s);

#ifdef PATCHGEMM_WITH_CUDA
namespace cuda {
// y = act((x - mean) * rstd * weight + bias) with mean, rstd [B, C] (accumulation dtype) computed
// here. x, y contiguous; weight, bias [C] or undefined.
void instance_norm_act_forward(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, double eps, bool gelu, const NormShape& s,
                               const at::Tensor& y, const at::Tensor& mean, const at::Tensor& rstd);
// grad_x, and the affine gradients grad_weight = sum(dz * xhat), grad_bias = sum(dz) over the
// batch and S (dz the gradient at the norm's affine output): [C] in x's dtype, or undefined where
// there is no weight / bias.
void instance_norm_act_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& mean, const at::Tensor& rstd, bool gelu,
                                const NormShape& s, const at::Tensor& grad_x,
                                const at::Tensor& grad_weight, const at::Tensor& grad_bias);
}  // namespace cuda
#endif

}  // namespace patchgemm
