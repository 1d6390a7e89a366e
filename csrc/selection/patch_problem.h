// The patch ops' problems as the selection tables and the implementations see them: the op's
// checked arguments plus the views every implementation starts from. Built once per call by the ops
// (patch_embed.cpp), after validation.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/patch/patchify.h"

namespace patchgemm {

// weight [rows, C, *k] as [rows, K] in the patch matrix's column order: (c, i, j, l), or (i, j, l, c)
// for channels-last x (a view where the weight lies that way too, else a copy).
at::Tensor weight_rows(const at::Tensor& weight, bool channels_last);

// The volume and geometry the fused kernels see: v5 and g, or for a channels-last volume the
// channels-first view of its pixels (patchify.h: channels_first_view), which must exist.
inline std::pair<at::Tensor, PatchGeometry> fused_view(const at::Tensor& v5, const PatchGeometry& g) {
  auto view = channels_first_view(v5, g);
  TORCH_INTERNAL_ASSERT(view, "fused_view: no channels-first view of ", v5.sizes(), " strides ", v5.strides());
  return *std::move(view);
}

// A value a problem makes at most once, for the first implementation that needs it. A problem
// lives for one call, and its tensors do not change while it does. (Autotune times every candidate
// on one problem: where they share such a value, none of them pays for it again.)
template <typename T>
class PerCall {
 public:
  template <typename Make>
  const T& get(Make make) const {
    if (!value_) value_ = make();
    return *value_;
  }

 private:
  mutable std::optional<T> value_;
};

// patch_embed: y = conv(x, weight, bias, stride = kernel) as tokens [B, N, E] or channels-first.
struct EmbedProblem {
  at::Tensor x, weight;  // as given: [B, C, *S], [E, C, *k]
  std::optional<at::Tensor> bias;
  bool tokens = false;     // the op's output format
  bool tokens_out = false; // the memory the GEMM writes is tokens [B, N, E] (also: one patch per
                           // sample, or channels-last output)
  PatchGeometry g;         // g.channels_last: x lies channels-last, and so does a channels-first output
  int64_t rank = 0;
  at::Tensor x5;                     // x as [B, C, D, H, W]
  std::vector<int64_t> out_shape;    // the op's output

  // weight as [E, K] in the patch matrix's column order. Made by the implementations that use it,
  // not with the problem: for channels-last x it is a copy, which cuDNN's path never needs.
  const at::Tensor& w2() const { return w2_.get([&] { return weight_rows(weight, g.channels_last); }); }
  // x5 and g as the fused kernels see them (where fused_kernels_apply holds).
  const std::pair<at::Tensor, PatchGeometry>& fused() const { return fused_.get([&] { return fused_view(x5, g); }); }

 private:
  PerCall<at::Tensor> w2_;
  PerCall<std::pair<at::Tensor, PatchGeometry>> fused_;
};

// patch_unembed: y = conv_transpose(x, weight, bias, stride = kernel), [B, C_out, *(grid * k)].
struct UnembedProblem {
  at::Tensor x, weight;  // as given: tokens [B, N, C_in] or channels-first [B, C_in, *grid]; [C_in, C_out, *k]
  std::optional<at::Tensor> bias;
  bool tokens = false;
  PatchGeometry g;
  int64_t rank = 0;
  at::Tensor x_tokens;  // [B, N, C_in] (a view)
  at::Tensor x_fused;   // what the fused kernels read: tokens [B, N, C_in] or channels-first [B, C_in, N]
  std::vector<int64_t> out_shape;
  at::MemoryFormat out_format = at::MemoryFormat::Contiguous;  // channels-last input: channels-last out

  // [C_in, K], as EmbedProblem's
  const at::Tensor& w2() const { return w2_.get([&] { return weight_rows(weight, g.channels_last); }); }
  // Whether the fused kernels read x as tokens (x_tokens): tokens input, or a channels-last volume,
  // whose channels are innermost too.
  bool fused_reads_tokens() const { return tokens || g.channels_last; }

 private:
  PerCall<at::Tensor> w2_;
};

// patch_weight_grad: (dW [E, C, *k], dbias [E], [C] (transposed) or [0]).
struct WeightGradProblem {
  at::Tensor grad_y, x;  // as given
  bool tokens = false, with_bias = false, transposed = false;
  PatchGeometry g;
  int64_t rank = 0, embed = 0;
  at::Tensor x5;  // [B, C, D, H, W]
  at::Tensor dy;  // grad_y as [B, N, E] (a view; channels-first grad_y through its strides)
  std::vector<int64_t> w_shape;

  // x5 and g as the fused kernels see them (where fused_kernels_apply holds).
  const std::pair<at::Tensor, PatchGeometry>& fused() const { return fused_.get([&] { return fused_view(x5, g); }); }

 private:
  PerCall<std::pair<at::Tensor, PatchGeometry>> fused_;
};

using WeightGrads = std::tuple<at::Tensor, at::Tensor>;

// x5 as its own patch matrix [B, 1, K] when one patch covers the whole volume and the strides allow
// a view (no gather at all: e.g. Qwen2-VL's patch embedding).
std::optional<at::Tensor> patch_matrix_as_view(const at::Tensor& x5, const PatchGeometry& g);

// The implementations on gather / scatter + one GEMM (patch_gemm.cpp): every backend.
at::Tensor embed_by_gemm(const EmbedProblem& p);          // the patch matrix gathered, or a view of x
// The op's output from the tokens [B, N, E] the GEMM wrote (a view: tokens, channels-first with one
// patch per sample, or channels-last).
at::Tensor embed_output(const EmbedProblem& p, const at::Tensor& y_tokens);
at::Tensor embed_by_aten_linear(const EmbedProblem& p);   // tokens_out: ATen's permute + reshape copy, then linear
at::Tensor embed_by_aten_conv(const EmbedProblem& p);     // ATen's convolution (cuDNN's on CUDA)
at::Tensor unembed_by_gemm(const UnembedProblem& p);      // GEMM, then the scatter
at::Tensor unembed_by_aten_linear(const UnembedProblem& p);  // ATen's matmul, then a permute copy and the bias
at::Tensor unembed_by_aten_conv_transpose(const UnembedProblem& p);  // ATen's transposed convolution
// Whether unembed_by_gemm's GEMM reads channels-first x poorly (a small grid, or rows that are not
// 16-byte aligned); where the patches are long enough, it then copies x into tokens order first.
bool unembed_gemm_reads_x_poorly(const UnembedProblem& p);
WeightGrads weight_grad_by_gemm(const WeightGradProblem& p);
// dW [E, K] in the patch matrix's column order as the weight's shape [E, C, *k]: a view where it can
// be (channels-last x: channels-last strides, as PyTorch's convolution backward gives).
at::Tensor weight_grad_in_weight_shape(const at::Tensor& rows, const WeightGradProblem& p);
// The bias gradient by a sum over grad_y (or x, transposed), for paths whose GEMM does not yield it.
at::Tensor bias_grad_by_sum(const WeightGradProblem& p);

// The selection tables (selection/patch_tables.cpp): the implementation each call runs.
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
