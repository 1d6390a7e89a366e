// instance_norm_act and its backward (see kernels/norm/instance_norm.h): validation, then the
// implementation its table (selection/norm_tables.cpp) picks; the affine gradients from its sums.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ops/checks.h"
#include "ops/instance_norm.h"
#include "selection/norm_tables.h"

namespace patchgemm {

NormShape norm_shape(const char* op, const at::Tensor& x, bool tokens) {
  NormShape s;
  s.tokens = tokens;
  if (tokens) {
    check_dim(op, "x", x, 3, "tokens [B, N, C]");
    s.batch = x.size(0);
    s.spatial = x.size(1);
    s.channels = x.size(2);
  } else {
    TORCH_CHECK(x.dim() >= 3, op, ": x must be channels-first [B, C, *spatial] with at least one "
                "spatial dim, got shape ", x.sizes());
    s.batch = x.size(0);
    s.channels = x.size(1);
    s.spatial = 1;
    for (int64_t d = 2; d < x.dim(); ++d) s.spatial *= x.size(d);
  }
  return s;
}

namespace {

constexpr const char* kOp = "instance_norm_act";

void check_affine(const char* op, const char* name, const std::optional<at::Tensor>& t,
                  const at::Tensor& x, const NormShape& s) {
  if (!t || !t->defined()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == s.channels, op, ": ", name, " must be [",
              s.channels, "] (one per channel of x ", x.sizes(), "), got shape ", t->sizes());
  check_like(op, name, *t, "x", x);
}

at::Tensor defined_or_empty(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? t->contiguous() : at::Tensor();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act(
    const at::Tensor& x_in, const std::optional<at::Tensor>& weight_in,
    const std::optional<at::Tensor>& bias_in, double eps, bool gelu, bool tokens) {
  check_floating(kOp, "x", x_in);
  const NormShape s = norm_shape(kOp, x_in, tokens);
  check_affine(kOp, "weight", weight_in, x_in, s);
  check_affine(kOp, "bias", bias_in, x_in, s);
  TORCH_CHECK(eps >= 0 && std::isfinite(eps), kOp, ": eps must be finite and >= 0, got ", eps);
  return select_instance_norm_act(
      {x_in.contiguous(), defined_or_empty(weight_in), defined_or_empty(bias_in), eps, gelu, s});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_backward(
    const at::Tensor& grad_y_in, const at::Tensor& x_in, const std::optional<at::Tensor>& weight_in,
    const std::optional<at::Tensor>& bias_in, const at::Tensor& mean, const at::Tensor& rstd,
    bool gelu, bool tokens) {
  constexpr const char* op = "instance_norm_act_backward";
  check_floating(op, "x", x_in);
  const NormShape s = norm_shape(op, x_in, tokens);
  TORCH_CHECK(grad_y_in.sizes() == x_in.sizes(), op, ": grad_y has shape ", grad_y_in.sizes(),
              " but x has ", x_in.sizes());
  check_like(op, "grad_y", grad_y_in, "x", x_in);
  check_affine(op, "weight", weight_in, x_in, s);
  check_affine(op, "bias", bias_in, x_in, s);
  for (const at::Tensor* t : {&mean, &rstd}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == s.batch && t->size(1) == s.channels &&
                    t->scalar_type() == norm_acc_dtype(x_in) && t->device() == x_in.device(),
                op, ": mean and rstd must be [", s.batch, ", ", s.channels, "] ",
                norm_acc_dtype(x_in), " on ", x_in.device(), " (from instance_norm_act), got ",
                t->sizes(), " ", t->scalar_type());
  }
  const at::Tensor x = x_in.contiguous(), weight = defined_or_empty(weight_in), bias = defined_or_empty(bias_in);
  auto [grad_x, grad_w, grad_b] = select_instance_norm_act_backward(
      {grad_y_in.contiguous(), x, weight, bias, mean.contiguous(), rstd.contiguous(), gelu, s});
  // The schema returns tensors: [0] where there is no weight / bias.
  for (at::Tensor* t : {&grad_w, &grad_b}) {
    if (!t->defined()) *t = at::empty({0}, x.options());
  }
  return {grad_x, grad_w, grad_b};
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("instance_norm_act", &instance_norm_act);
  m.impl("instance_norm_act_backward", &instance_norm_act_backward);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("instance_norm_act", &instance_norm_act);
  m.impl("instance_norm_act_backward", &instance_norm_act_backward);
}
#endif

}  // namespace patchgemm
