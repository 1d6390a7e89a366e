// GEMMs of many small groups over channels-first data (grouped pointwise convolution): G groups of
// at most 128 channels, each multiplied by its own small matrix at every position. At a few flops
// per byte this is memory-bound, and a batched BLAS call of [<= 128 x 128] @ [128 x L] GEMMs reaches
// a third of the bandwidth. These kernels stream x once and write y once, each group's matrix on
// chip (kernels/gemm/sm80/small_group_gemm.cu). CUDA sm_80+, 16-bit, and fp32 for apply in TF32
// (the caller checks that TF32 is allowed); where one declines (the reason in `why`), the caller's
// table runs cuBLAS or ATen.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace patchgemm {
namespace cuda {

// out[b, g] = matrix[g] @ x[b, g] (+ bias[g] at every position), fp32 accumulation (TF32 products
// for fp32 data):
// x [B, G, K, L], matrix [G, M, K] (any strides), bias [G, M] (any strides), out [B, G, M, L];
// M, K <= 128, and the positions (L) of x and out contiguous in 16-byte aligned runs of 8.
bool small_group_apply(const at::Tensor& matrix, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       const at::Tensor& out, std::string& why);

// grad_w [G, M, K] = sum over b and l of grad_y[b, g, :, l] x[b, g, :, l]^T, summed in fp32 and
// rounded once: grad_y [B, G, M, L], x [B, G, K, L], as small_group_apply's x and out; grad_w
// contiguous. Where grad_b [G, M] (contiguous) is defined (K < 128 required), the bias gradient too:
// grad_y summed over b and l, in the same pass.
bool small_group_weight_grad(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& grad_w,
                             const at::Tensor& grad_b, std::string& why);

}  // namespace cuda
}  // namespace patchgemm
