// The patch ops on gather / scatter + one GEMM, on every backend (patch_gemm.cpp); see
// problems/patch_geometry.h for the patch matrix.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "problems/patch.h"

namespace patchgemm {

// x5 as its own patch matrix [B, 1, K] when one patch covers the whole volume and the strides allow
// a view (no gather at all: e.g. Qwen2-VL's patch embedding).
std::optional<at::Tensor> patch_matrix_as_view(const at::Tensor& x5, const PatchGeometry& g);

at::Tensor embed_by_gemm(const EmbedProblem& p);          // the patch matrix gathered, or a view of x
// The op's output from the tokens [B, N, E] the GEMM wrote (a view: tokens, channels-first with one
// patch per sample, or channels-last).
at::Tensor embed_output(const EmbedProblem& p, const at::Tensor& y_tokens);
at::Tensor embed_by_aten_linear(const EmbedProblem& p);   // tokens_out: ATen's permute + reshape copy, then linear
at::Tensor unembed_by_gemm(const UnembedProblem& p);      // GEMM, then the scatter
at::Tensor unembed_by_aten_linear(const UnembedProblem& p);  // ATen's matmul, then a permute copy and the bias
// Whether unembed_by_gemm's GEMM reads channels-first x poorly (a small grid, or rows that are not
// 16-byte aligned); where the patches are long enough, it then copies x into tokens order first.
bool unembed_gemm_reads_x_poorly(const UnembedProblem& p);
WeightGrads weight_grad_by_gemm(const WeightGradProblem& p);
// The same GEMM on p.saved_patches (patch_embed's forward made it, or for patch_unembed's backward
// the embedding of grad_y that gave dx): no gather.
WeightGrads weight_grad_by_saved_patches(const WeightGradProblem& p);
// dW [E, K] in the patch matrix's column order as the weight's shape [E, C, *k]: a view where it can
// be (channels-last x: channels-last strides, as PyTorch's convolution backward gives).
at::Tensor weight_grad_in_weight_shape(const at::Tensor& rows, const WeightGradProblem& p);
// The bias gradient by a sum over grad_y (or x, transposed), for paths whose GEMM does not yield it.
at::Tensor bias_grad_by_sum(const WeightGradProblem& p);

}  // namespace patchgemm
