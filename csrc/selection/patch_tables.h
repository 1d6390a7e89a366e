// The patch ops' selection tables (patch_tables.cpp): the implementation each call runs, and
// PyTorch's own convolutions as candidates.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "problems/patch.h"

namespace patchgemm {

at::Tensor embed_by_aten_conv(const EmbedProblem& p);                // ATen's convolution (cuDNN's on CUDA)
at::Tensor unembed_by_aten_conv_transpose(const UnembedProblem& p);  // ATen's transposed convolution

// Whether patch_embed's weight gradient would take the patch matrix its forward `p` made
// (saved_patches: forced, or its rule passes; grad_y taken to lie as y): the autograd layer keeps
// that matrix, x-sized memory, only then. `transposed`: patch_unembed's weight gradient, where `p`
// is the embedding of its grad_y that gave dx.
bool weight_grad_takes_patch_matrix(const EmbedProblem& p, bool with_bias, bool transposed = false);

// The implementation each call runs.
at::Tensor select_patch_embed(const EmbedProblem& p);
at::Tensor select_patch_unembed(const UnembedProblem& p);
WeightGrads select_patch_weight_grad(const WeightGradProblem& p);
// Whether patch_embed's choice for `p` is ATen's convolution, settled without running anything
// (forced, or the heuristic's first candidate that applies and is not ruled out), with neither
// backward op forced; noted for explain() if so. Then the op can run as that convolution with
// PyTorch's own autograd (ops/patch_embed.cpp).
bool embed_settles_on_aten_conv(const EmbedProblem& p);
// The same for patch_unembed and ATen's transposed convolution.
bool unembed_settles_on_aten_conv_transpose(const UnembedProblem& p);

}  // namespace patchgemm
