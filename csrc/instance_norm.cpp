// instance_norm_act and its backward (see instance_norm.h): validation, the CUDA kernels, and an
// ATen version (CPU, and the reference the tests compare the kernels with).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "checks.h"
#include "instance_norm.h"

namespace patchgemm {
namespace {

constexpr const char* kOp = "instance_norm_act";

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

at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// x as [B, C, S] in the accumulation dtype (a view of tokens input, transposed).
at::Tensor as_bcs(const at::Tensor& x, const NormShape& s) {
  const at::Tensor v = s.tokens ? x.reshape({s.batch, s.spatial, s.channels}).transpose(1, 2)
                                : x.reshape({s.batch, s.channels, s.spatial});
  return v.to(acc_dtype(x));
}

// The inverse of as_bcs, in x's dtype and shape, contiguous.
at::Tensor from_bcs(const at::Tensor& t, const at::Tensor& like, const NormShape& s) {
  const at::Tensor v = s.tokens ? t.transpose(1, 2) : t;
  return v.to(like.scalar_type()).contiguous().view(like.sizes());
}

at::Tensor per_channel(const at::Tensor& t, double fill, const NormShape& s, const at::Tensor& x) {
  const auto options = x.options().dtype(acc_dtype(x));
  return (t.defined() ? t.to(acc_dtype(x)) : at::full({s.channels}, fill, options)).view({1, -1, 1});
}

// xhat and z = xhat * weight + bias, [B, C, S] in the accumulation dtype.
std::pair<at::Tensor, at::Tensor> normalized(const at::Tensor& x, const at::Tensor& weight,
                                             const at::Tensor& bias, const at::Tensor& mean,
                                             const at::Tensor& rstd, const NormShape& s) {
  const at::Tensor xhat = (as_bcs(x, s) - mean.unsqueeze(2)) * rstd.unsqueeze(2);
  return {xhat, xhat * per_channel(weight, 1.0, s, x) + per_channel(bias, 0.0, s, x)};
}

at::Tensor gelu_grad(const at::Tensor& z) {
  const at::Tensor cdf = 0.5 * (1.0 + at::erf(z * M_SQRT1_2));
  return cdf + z * at::exp(-0.5 * z * z) * (0.5 * M_2_SQRTPI * M_SQRT1_2);
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
  const at::Tensor x = x_in.contiguous(), weight = defined_or_empty(weight_in),
                   bias = defined_or_empty(bias_in);
#ifdef PATCHGEMM_WITH_CUDA
  if (x.is_cuda()) {
    const auto acc = x.options().dtype(acc_dtype(x));
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    at::Tensor mean = at::empty({s.batch, s.channels}, acc), rstd = at::empty_like(mean);
    cuda::instance_norm_act_forward(x, weight, bias, eps, gelu, s, y, mean, rstd);
    return {y, mean, rstd};
  }
#endif
  const at::Tensor xf = as_bcs(x, s);
  const at::Tensor mean = xf.mean(-1);
  const at::Tensor rstd = (xf.var(-1, /*unbiased=*/false) + eps).rsqrt();
  const at::Tensor z = normalized(x, weight, bias, mean, rstd, s).second;
  return {from_bcs(gelu ? at::gelu(z) : z, x, s), mean, rstd};
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
                    t->scalar_type() == acc_dtype(x_in) && t->device() == x_in.device(),
                op, ": mean and rstd must be [", s.batch, ", ", s.channels, "] ",
                acc_dtype(x_in), " on ", x_in.device(), " (from instance_norm_act), got ",
                t->sizes(), " ", t->scalar_type());
  }
  const at::Tensor x = x_in.contiguous(), grad_y = grad_y_in.contiguous();
  const at::Tensor weight = defined_or_empty(weight_in), bias = defined_or_empty(bias_in);
  at::Tensor grad_x, sum_dz, sum_dz_xhat;
#ifdef PATCHGEMM_WITH_CUDA
  if (x.is_cuda()) {
    grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
    sum_dz = at::empty({s.batch, s.channels}, mean.options());
    sum_dz_xhat = at::empty_like(sum_dz);
    cuda::instance_norm_act_backward(grad_y, x, weight, bias, mean.contiguous(), rstd.contiguous(),
                                     gelu, s, grad_x, sum_dz, sum_dz_xhat);
  }
#endif
  if (!sum_dz.defined()) {
    const auto [xhat, z] = normalized(x, weight, bias, mean, rstd, s);
    at::Tensor dz = as_bcs(grad_y, s);
    if (gelu) dz = dz * gelu_grad(z);
    sum_dz = dz.sum(-1);
    sum_dz_xhat = (dz * xhat).sum(-1);
    const double inv_n = s.spatial ? 1.0 / static_cast<double>(s.spatial) : 0.0;
    const at::Tensor dx = rstd.unsqueeze(2) * per_channel(weight, 1.0, s, x) *
                          (dz - sum_dz.unsqueeze(2) * inv_n - xhat * sum_dz_xhat.unsqueeze(2) * inv_n);
    grad_x = from_bcs(dx, x, s);
  }
  const auto options = x.options();
  at::Tensor grad_w = weight.defined() ? sum_dz_xhat.sum(0).to(x.scalar_type()) : at::empty({0}, options);
  at::Tensor grad_b = bias.defined() ? sum_dz.sum(0).to(x.scalar_type()) : at::empty({0}, options);
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
