// Grouped linear: G independent linears over the groups of x, each op one strided-batched GEMM
// (batch = G) that reads x / grad_y in place and writes its output in its final layout.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "selection/grouped_linear_tables.h"

namespace patchgemm {
namespace {

const char* layout_name(bool group_major) { return group_major ? "[G, B, D]" : "[B, G, D]"; }

// The [G, B, D] view of a tensor in either layout (a transpose, never a copy).
at::Tensor by_group(const at::Tensor& t, bool group_major) {
  return group_major ? t : t.transpose(0, 1);
}

int64_t num_groups(const at::Tensor& t, bool group_major) { return t.size(group_major ? 0 : 1); }

// Checks a [B, G, D] / [G, B, D] activation against weight[G, Dout, Din] along `feature_dim`.
void check_activation(const char* op, const char* name, const at::Tensor& t,
                      const at::Tensor& weight, int64_t weight_feature_dim, bool group_major) {
  check_dim(op, name, t, 3, layout_name(group_major));
  check_floating(op, name, t);
  TORCH_CHECK(num_groups(t, group_major) == weight.size(0), op, ": ", name, " has ",
              num_groups(t, group_major), " groups (shape ", t.sizes(), ", layout ",
              layout_name(group_major), ") but weight has ", weight.size(0), " (shape ",
              weight.sizes(), ")");
  TORCH_CHECK(t.size(2) == weight.size(weight_feature_dim), op, ": ", name, " has ", t.size(2),
              " features per group (shape ", t.sizes(), ") but weight [G, Dout, Din] expects ",
              weight.size(weight_feature_dim), " (shape ", weight.sizes(), ")");
  check_like(op, name, t, "weight", weight);
}

void check_weight(const char* op, const at::Tensor& weight) {
  check_dim(op, "weight", weight, 3, "[G, Dout, Din]");
  check_floating(op, "weight", weight);
}

at::Tensor empty_like_layout(const at::Tensor& t, int64_t features) {
  return at::empty({t.size(0), t.size(1), features}, t.options());
}

}  // namespace

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, bool group_major) {
  constexpr const char* op = "grouped_linear";
  check_weight(op, weight);
  check_activation(op, "x", x, weight, 2, group_major);
  if (bias) {
    check_dim(op, "bias", *bias, 2, "[G, Dout]");
    TORCH_CHECK(bias->size(0) == weight.size(0) && bias->size(1) == weight.size(1), op,
                ": bias must be [G, Dout] = [", weight.size(0), ", ", weight.size(1),
                "] to match weight ", weight.sizes(), ", got ", bias->sizes());
    check_like(op, "bias", *bias, "weight", weight);
  }
  at::Tensor y = empty_like_layout(x, weight.size(1));
  // y_g[B, Dout] = x_g[B, Din] @ weight_g^T
  return select_grouped_gemm({op, by_group(x, group_major), weight.transpose(1, 2), bias, y, by_group(y, group_major)});
}

at::Tensor grouped_linear_grad_input(const at::Tensor& grad_y, const at::Tensor& weight,
                                     bool group_major) {
  constexpr const char* op = "grouped_linear_grad_input";
  check_weight(op, weight);
  check_activation(op, "grad_y", grad_y, weight, 1, group_major);
  at::Tensor grad_x = empty_like_layout(grad_y, weight.size(2));
  // grad_x_g[B, Din] = grad_y_g[B, Dout] @ weight_g
  return select_grouped_gemm({op, by_group(grad_y, group_major), weight, std::nullopt, grad_x,
                              by_group(grad_x, group_major)});
}

at::Tensor grouped_linear_grad_weight(const at::Tensor& grad_y, const at::Tensor& x,
                                      bool group_major) {
  constexpr const char* op = "grouped_linear_grad_weight";
  check_dim(op, "grad_y", grad_y, 3, layout_name(group_major));
  check_dim(op, "x", x, 3, layout_name(group_major));
  check_floating(op, "x", x);
  check_like(op, "grad_y", grad_y, "x", x);
  const int64_t batch_dim = group_major ? 1 : 0;
  TORCH_CHECK(num_groups(grad_y, group_major) == num_groups(x, group_major) &&
                  grad_y.size(batch_dim) == x.size(batch_dim),
              op, ": grad_y ", grad_y.sizes(), " and x ", x.sizes(),
              " must agree in batch and group sizes (layout ", layout_name(group_major), ")");
  at::Tensor grad_w = at::empty({x.size(group_major ? 0 : 1), grad_y.size(2), x.size(2)},
                                x.options());
  // grad_w_g[Dout, Din] = grad_y_g^T[Dout, B] @ x_g[B, Din]
  return select_grouped_gemm({op, by_group(grad_y, group_major).transpose(1, 2), by_group(x, group_major),
                              std::nullopt, grad_w, grad_w});
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("grouped_linear", &grouped_linear);
  m.impl("grouped_linear_grad_input", &grouped_linear_grad_input);
  m.impl("grouped_linear_grad_weight", &grouped_linear_grad_weight);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("grouped_linear", &grouped_linear);
  m.impl("grouped_linear_grad_input", &grouped_linear_grad_input);
  m.impl("grouped_linear_grad_weight", &grouped_linear_grad_weight);
}
#endif

}  // namespace patchgemm
