// The patch ops' C++ (patch_embed.cpp) that the autograd layer (autograd.cpp) also runs.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "problems/patch.h"

namespace patchgemm {

// The patch ops' `levels` argument (int[]?): None and [] both mean row-major tokens.
inline c10::IntArrayRef token_levels(at::OptionalIntArrayRef levels) { return levels.value_or(c10::IntArrayRef{}); }

// x [B, C, *S] without the last positions of each spatial dim that fill no whole patch of weight
// [E, C, *k], which a kernel == stride convolution leaves out: a view, or x itself where every
// size is a multiple (and where levels order the tokens: those need whole grids). Both the autograd
// layer and the op take it, so a backward sees only the positions the forward read and autograd
// gives the rest a zero gradient (ops/patch_embed.cpp).
at::Tensor whole_patches(const at::Tensor& x, const at::Tensor& weight, c10::IntArrayRef levels);

// For the autograd layer (ops/autograd.cpp), which runs a plain call (ops/checks.h: plain_call) from
// its problem, checked once, instead of through the dispatcher (ops/patch_embed.cpp). x: whole
// patches (whole_patches).
EmbedProblem embed_problem(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           bool tokens, c10::IntArrayRef levels);
UnembedProblem unembed_problem(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               bool tokens, c10::IntArrayRef levels);
WeightGradProblem weight_grad_problem(const at::Tensor& grad_y, const at::Tensor& x, c10::IntArrayRef kernel,
                                      bool tokens, c10::IntArrayRef levels, bool with_bias, bool transposed);
// patch_weight_grad's result: the chosen implementation's, in the weight's memory format.
WeightGrads patch_weight_grads(const WeightGradProblem& p);
// Whether the autograd layer asks if a call's choice settles on ATen's (transposed) convolution
// (embed_settles_on_aten_conv): for channels-last x only, where the rules send calls to cuDNN on real
// models (ConvNeXt's downsampling); elsewhere the question would cost every call a second pass over
// the table. Where it does settle, the autograd layer calls that convolution with autograd on, so
// PyTorch's autograd records it: one convolution_backward for dx, dW and db, as nn.Conv*d's.
inline bool may_settle_on_aten(const PatchGeometry& g) { return g.channels_last && g.levels.size() == 1; }

}  // namespace patchgemm
