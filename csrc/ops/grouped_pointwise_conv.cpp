// Grouped pointwise convolution: F.conv{1,2,3}d(x, weight, bias, groups=G) with kernel size 1, i.e.
// G independent small linears over the channel groups of every position. Validation here, once;
// the tables in selection/grouped_pointwise_conv_tables.cpp run it. The output takes the memory format x
// suggests, as PyTorch's convolutions do: channels_last(_3d) x is the tokens problem [N, G, c_in],
// anything else is made contiguous and runs channels-first [B, G, c_in, L].
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "selection/grouped_pointwise_conv_tables.h"

namespace patchgemm {
namespace {

// The memory format of the op's output: x's where it lies channels-last (the tokens problem).
at::MemoryFormat output_format(const at::Tensor& x) {
  return lies_channels_last(x) ? x.suggest_memory_format() : at::MemoryFormat::Contiguous;
}

// The problem's view of a [B, C, *S] tensor with C = G * c: [B, G, c, L] or (tokens) [N, G, c].
at::Tensor grouped_view(const at::Tensor& t, bool tokens, int64_t groups) {
  const int64_t per_group = t.size(1) / groups;
  if (tokens) return t.movedim(1, -1).view({-1, groups, per_group});
  return t.view({t.size(0), groups, per_group, -1});
}

void check_activation(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() >= 3 && t.dim() <= 5, op, ": ", name,
              " must be [B, C, *spatial] with 1 to 3 spatial dims, got shape ", t.sizes());
  check_floating(op, name, t);
}

// weight [C_out, C_in / G, 1, ...]: checks it against the channels and groups; returns C_in / G.
void check_weight(const char* op, const at::Tensor& weight, int64_t rank, int64_t groups) {
  TORCH_CHECK(groups >= 1, op, ": groups must be >= 1, got ", groups);
  TORCH_CHECK(weight.dim() == rank, op, ": weight must be [C_out, C_in / groups",
              rank == 3   ? ", 1"
              : rank == 4 ? ", 1, 1"
                          : ", 1, 1, 1",
              "] for x of ", rank, " dims, got shape ", weight.sizes());
  for (int64_t d = 2; d < rank; ++d) {
    TORCH_CHECK(weight.size(d) == 1, op, ": the kernel must be 1 in every spatial dim (a pointwise conv), got weight ",
                weight.sizes());
  }
  TORCH_CHECK(weight.size(0) % groups == 0, op, ": weight's C_out = ", weight.size(0),
              " must be a multiple of groups = ", groups, " (weight ", weight.sizes(), ")");
  check_floating(op, "weight", weight);
}

at::Tensor group_matrix(const at::Tensor& weight, int64_t groups) {
  return weight.reshape({groups, weight.size(0) / groups, weight.size(1)});
}

// The op's result: `out` where a candidate wrote the problem's output view `out_view` of `result`;
// a tensor of its own (aten_conv) in the format decided here as it is (ATen's CPU conv3d, e.g.,
// ignores channels_last_3d), else copied into `result`.
at::Tensor result_in(at::MemoryFormat format, const at::Tensor& out, const at::Tensor& out_view,
                     const at::Tensor& result) {
  if (out.is_same(out_view)) return result;
  return out.is_contiguous(format) ? out : result.copy_(out);
}

}  // namespace

at::Tensor grouped_pointwise_conv(const at::Tensor& x_in, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, int64_t groups) {
  constexpr const char* op = "grouped_pointwise_conv";
  check_activation(op, "x", x_in);
  check_weight(op, weight, x_in.dim(), groups);
  check_like(op, "x", x_in, "weight", weight);
  TORCH_CHECK(x_in.size(1) == groups * weight.size(1), op, ": x has ", x_in.size(1), " channels (shape ", x_in.sizes(),
              ") but weight ", weight.sizes(), " with groups = ", groups, " expects ", groups * weight.size(1));
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must be [C_out] = [", weight.size(0),
                "], got ", bias->sizes());
    check_like(op, "bias", *bias, "weight", weight);
  }
  const at::MemoryFormat format = output_format(x_in);
  const bool tokens = format != at::MemoryFormat::Contiguous;
  const at::Tensor x = x_in.contiguous(format);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[1] = weight.size(0);
  at::Tensor y = at::empty(sizes, x.options().memory_format(format));
  std::optional<at::Tensor> bias_g;
  if (bias) bias_g = bias->view({groups, -1});
  GroupedPointwiseConvProblem p{op,
                                backward_follows_depth() > 0,
                                tokens,
                                grouped_view(x, tokens, groups),
                                group_matrix(weight, groups),
                                bias_g,
                                grouped_view(y, tokens, groups),
                                sizes,
                                x,
                                groups};
  return result_in(format, select_grouped_pointwise_conv(p), p.out, y);
}

at::Tensor grouped_pointwise_conv_grad_input(const at::Tensor& grad_y_in, const at::Tensor& weight, int64_t groups) {
  constexpr const char* op = "grouped_pointwise_conv_grad_input";
  check_activation(op, "grad_y", grad_y_in);
  check_weight(op, weight, grad_y_in.dim(), groups);
  check_like(op, "grad_y", grad_y_in, "weight", weight);
  TORCH_CHECK(grad_y_in.size(1) == weight.size(0), op, ": grad_y has ", grad_y_in.size(1), " channels (shape ",
              grad_y_in.sizes(), ") but weight ", weight.sizes(), " has C_out = ", weight.size(0));
  const at::MemoryFormat format = output_format(grad_y_in);
  const bool tokens = format != at::MemoryFormat::Contiguous;
  const at::Tensor grad_y = grad_y_in.contiguous(format);
  std::vector<int64_t> sizes = grad_y.sizes().vec();
  sizes[1] = groups * weight.size(1);
  at::Tensor grad_x = at::empty(sizes, grad_y.options().memory_format(format));
  GroupedPointwiseConvProblem p{op,
                                false,
                                tokens,
                                grouped_view(grad_y, tokens, groups),
                                group_matrix(weight, groups).transpose(1, 2),
                                std::nullopt,
                                grouped_view(grad_x, tokens, groups),
                                sizes,
                                grad_y,
                                groups};
  return result_in(format, select_grouped_pointwise_conv(p), p.out, grad_x);
}

std::tuple<at::Tensor, at::Tensor> grouped_pointwise_conv_grad_weight(const at::Tensor& grad_y_in,
                                                                      const at::Tensor& x_in, int64_t groups,
                                                                      bool with_bias) {
  constexpr const char* op = "grouped_pointwise_conv_grad_weight";
  check_activation(op, "grad_y", grad_y_in);
  check_activation(op, "x", x_in);
  check_like(op, "grad_y", grad_y_in, "x", x_in);
  TORCH_CHECK(groups >= 1 && x_in.size(1) % groups == 0 && grad_y_in.size(1) % groups == 0, op, ": groups = ", groups,
              " must divide the channels of x ", x_in.sizes(), " and grad_y ", grad_y_in.sizes());
  TORCH_CHECK(grad_y_in.dim() == x_in.dim() && grad_y_in.size(0) == x_in.size(0) &&
                  grad_y_in.sizes().slice(2) == x_in.sizes().slice(2),
              op, ": grad_y ", grad_y_in.sizes(), " and x ", x_in.sizes(), " must agree in batch and spatial sizes");
  const at::MemoryFormat format = output_format(x_in);
  const bool tokens = format != at::MemoryFormat::Contiguous;
  const at::Tensor x = x_in.contiguous(format), grad_y = grad_y_in.contiguous(format);
  auto [grad_w, grad_b] = select_grouped_pointwise_conv_weight_grad(
      {tokens, grouped_view(grad_y, tokens, groups), grouped_view(x, tokens, groups), with_bias});
  std::vector<int64_t> sizes(x.dim(), 1);
  sizes[0] = grad_y.size(1);
  sizes[1] = x.size(1) / groups;
  return {grad_w.reshape(sizes), with_bias ? grad_b.reshape({-1}) : at::empty({0}, x.options())};
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("grouped_pointwise_conv", &grouped_pointwise_conv);
  m.impl("grouped_pointwise_conv_grad_input", &grouped_pointwise_conv_grad_input);
  m.impl("grouped_pointwise_conv_grad_weight", &grouped_pointwise_conv_grad_weight);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("grouped_pointwise_conv", &grouped_pointwise_conv);
  m.impl("grouped_pointwise_conv_grad_input", &grouped_pointwise_conv_grad_input);
  m.impl("grouped_pointwise_conv_grad_weight", &grouped_pointwise_conv_grad_weight);
}
#endif

}  // namespace patchgemm
