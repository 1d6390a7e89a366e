// The patch ops' problems as every layer sees them: the op's checked arguments plus the views every
// implementation starts from. Built once per call by the ops (ops/patch_embed.cpp), after
// validation; the selection tables (selection/patch_tables.h) and the host paths
// (kernels/patch/patch_gemm.h) take them.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "problems/patch_geometry.h"

namespace patchgemm {

// weight [rows, C, *k] as [rows, K] in the patch matrix's column order: (c, i, j, l), or (i, j, l, c)
// for channels-last x (a view where the weight lies that way too, else a copy).
at::Tensor weight_rows(const at::Tensor& weight, bool channels_last);

// The volume and geometry the fused kernels see: v5 and g, or for a channels-last volume the
// channels-first view of its pixels (patch_geometry.h: channels_first_view), which must exist.
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

// A patch matrix of x as the GEMM paths make it: rows [B, N, ld] whose first K columns are the
// patches (in PatchGeometry's column order) and the rest alignment padding, or with `ones_column`
// a column of ones at K (the bias's) before it. merge_batch must merge B and N.
struct PatchMatrix {
  at::Tensor rows;
  bool ones_column = false;
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
  // Set by the autograd layer where the weight gradient follows this forward (training): runs that
  // gradient for a forward result y taken as grad_y, on the patch matrix the forward left where
  // `reusable`. The selection modes time each candidate with it (selection/registry.h, FollowUp).
  std::function<void(const at::Tensor& y, bool reusable)> weight_grad_after;
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)

  // weight as [E, K] in the patch matrix's column order. Made by the implementations that use it,
  // not with the problem: for channels-last x it is a copy, which cuDNN's path never needs.
  const at::Tensor& w2() const { return w2_.get([&] { return weight_rows(weight, g.channels_last); }); }
  // x5 and g as the fused kernels see them (where fused_kernels_apply holds).
  const std::pair<at::Tensor, PatchGeometry>& fused() const { return fused_.get([&] { return fused_view(x5, g); }); }

  // The patch matrix an implementation gathered (or copied) from x and multiplied, which the
  // autograd layer keeps for the weight gradient (its GEMM then reads it instead of gathering x
  // again, as the linear rewrite's backward does). None where the implementation read x in place.
  void made_patch_matrix(PatchMatrix m) const { patches_ = std::move(m); }
  void forget_patch_matrix() const { patches_.reset(); }  // before each run: the last run's only
  const std::optional<PatchMatrix>& patch_matrix() const { return patches_; }

 private:
  PerCall<at::Tensor> w2_;
  PerCall<std::pair<at::Tensor, PatchGeometry>> fused_;
  mutable std::optional<PatchMatrix> patches_;
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
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)

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
  // patch_embed's backward: the patch matrix of x its forward made (EmbedProblem::patch_matrix),
  // which the saved_patches candidate multiplies without gathering x again; patch_unembed's
  // (transposed): the one of its grad_y that dx's embedding made. Set by the autograd layer only:
  // the op patch_weight_grad has no such argument.
  std::optional<PatchMatrix> saved_patches;
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)

  // x5 and g as the fused kernels see them (where fused_kernels_apply holds).
  const std::pair<at::Tensor, PatchGeometry>& fused() const { return fused_.get([&] { return fused_view(x5, g); }); }

 private:
  PerCall<std::pair<at::Tensor, PatchGeometry>> fused_;
};

using WeightGrads = std::tuple<at::Tensor, at::Tensor>;

}  // namespace patchgemm
