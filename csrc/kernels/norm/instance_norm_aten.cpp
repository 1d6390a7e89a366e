// instance_norm_act's ATen implementations (see instance_norm.h): the composite one, any device, the
// reference the tests compare the others with (it makes the passes and temporaries the fused kernels
// avoid), and the one through ATen's batch norm, the CPU's path.
#include <ATen/ATen.h>

#include <cmath>

#include "kernels/norm/instance_norm.h"

namespace patchgemm {
namespace {

// The dtype this implementation computes in: float64 on the CPU, as PyTorch's CPU norms accumulate
// float32 (at::acc_type<float, false>; a channel of a few nearly equal values loses digits in float32
// sums), else the statistics' dtype. The statistics it returns are in norm_acc_dtype either way.
at::ScalarType compute_dtype(const at::Tensor& x) { return x.is_cpu() ? at::kDouble : norm_acc_dtype(x); }

// x as [B, C, S] in the compute dtype (a view of tokens input, transposed).
at::Tensor as_bcs(const at::Tensor& x, const NormShape& s) {
  const at::Tensor v = s.tokens ? x.reshape({s.batch, s.spatial, s.channels}).transpose(1, 2)
                                : x.reshape({s.batch, s.channels, s.spatial});
  return v.to(compute_dtype(x));
}

// The inverse of as_bcs, in x's dtype and shape, contiguous.
at::Tensor from_bcs(const at::Tensor& t, const at::Tensor& like, const NormShape& s) {
  const at::Tensor v = s.tokens ? t.transpose(1, 2) : t;
  return v.to(like.scalar_type()).contiguous().view(like.sizes());
}

at::Tensor per_channel(const at::Tensor& t, double fill, const NormShape& s, const at::Tensor& x) {
  const auto options = x.options().dtype(compute_dtype(x));
  return (t.defined() ? t.to(compute_dtype(x)) : at::full({s.channels}, fill, options)).view({1, -1, 1});
}

// xhat and z = xhat * weight + bias, [B, C, S] in the compute dtype.
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

// x (or a gradient in x's layout) as batch norm's input [1, B * C, S] (a copy of tokens input).
at::Tensor as_batch_norm_input(const at::Tensor& x, const NormShape& s) {
  const at::Tensor bcs = s.tokens ? x.reshape({s.batch, s.spatial, s.channels}).transpose(1, 2)
                                  : x.reshape({s.batch, s.channels, s.spatial});
  return bcs.reshape({1, s.batch * s.channels, s.spatial});
}

// An affine parameter [C] repeated per sample, [B * C] (undefined stays undefined).
at::Tensor per_sample(const at::Tensor& param, const NormShape& s) {
  return param.defined() ? param.repeat({s.batch}) : at::Tensor();
}

// [1, B * C, S] back to x's layout and shape, contiguous.
at::Tensor from_batch_norm(const at::Tensor& t, const at::Tensor& like, const NormShape& s) {
  const at::Tensor bcs = t.view({s.batch, s.channels, s.spatial});
  return (s.tokens ? bcs.transpose(1, 2) : bcs).contiguous().view(like.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_batch_norm(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps, bool gelu,
    const NormShape& s) {
  const auto [z, mean, invstd] = at::native_batch_norm(as_batch_norm_input(x, s), per_sample(weight, s),
                                                       per_sample(bias, s), {}, {}, true, 0.0, eps);
  const at::ScalarType acc = norm_acc_dtype(x);
  return {from_batch_norm(gelu ? at::gelu(z) : z, x, s), mean.view({s.batch, s.channels}).to(acc),
          invstd.view({s.batch, s.channels}).to(acc)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_backward_batch_norm(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool gelu, const NormShape& s) {
  const at::Tensor input = as_batch_norm_input(x, s);
  const at::Tensor w = per_sample(weight, s), b = per_sample(bias, s);
  at::Tensor dz = as_batch_norm_input(grad_y, s);
  if (gelu) {
    // The norm's output again, by the forward's own kernel in one pass: batch norm in inference mode
    // with the saved statistics (variance 1 / rstd^2, eps 0) forms x * scale + shift per channel as
    // the training forward did, in x's dtype. (Elementwise ATen ops took five passes, in float32.)
    const at::ScalarType acc = mean.scalar_type();
    const auto as_acc = [&](const at::Tensor& t) { return t.defined() ? t.to(acc) : t; };
    const at::Tensor var = rstd.reshape({-1}).pow(-2);
    const at::Tensor z = std::get<0>(at::native_batch_norm(input, as_acc(w), as_acc(b), mean.reshape({-1}), var,
                                                           /*training=*/false, 0.0, /*eps=*/0.0));
    dz = at::gelu_backward(dz, z);
  }
  // The dtype batch norm saves its statistics in: x's, or float32 for 16-bit x with fp32 parameters.
  const bool mixed = weight.defined() && weight.scalar_type() != x.scalar_type();
  const at::ScalarType stats = mixed ? at::kFloat : x.scalar_type();
  const auto [gx, gw, gb] = at::native_batch_norm_backward(
      dz, input, w, {}, {}, mean.reshape({-1}).to(stats), rstd.reshape({-1}).to(stats), true, /*eps, unused*/ 0.0,
      {true, weight.defined(), bias.defined()});
  const auto affine_grad = [&](const at::Tensor& param, const at::Tensor& per_sample_grad) {
    return param.defined() ? per_sample_grad.view({s.batch, s.channels}).sum(0).to(x.scalar_type()) : at::Tensor();
  };
  return {from_batch_norm(gx, x, s), affine_grad(weight, gw), affine_grad(bias, gb)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_aten(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps, bool gelu,
    const NormShape& s) {
  const at::Tensor xf = as_bcs(x, s);
  const at::Tensor mean = xf.mean(-1);
  const at::Tensor rstd = (xf.var(-1, /*unbiased=*/false) + eps).rsqrt();
  const at::Tensor z = normalized(x, weight, bias, mean, rstd, s).second;
  return {from_bcs(gelu ? at::gelu(z) : z, x, s), mean.to(norm_acc_dtype(x)), rstd.to(norm_acc_dtype(x))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> instance_norm_act_backward_aten(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool gelu, const NormShape& s) {
  const at::ScalarType dtype = compute_dtype(x);
  const at::Tensor rstd_c = rstd.to(dtype);
  const auto [xhat, z] = normalized(x, weight, bias, mean.to(dtype), rstd_c, s);
  at::Tensor dz = as_bcs(grad_y, s);
  if (gelu) dz = dz * gelu_grad(z);
  const at::Tensor sum_dz = dz.sum(-1), sum_dz_xhat = (dz * xhat).sum(-1);
  const double inv_n = s.spatial ? 1.0 / static_cast<double>(s.spatial) : 0.0;
  const at::Tensor dx = rstd_c.unsqueeze(2) * per_channel(weight, 1.0, s, x) *
                        (dz - sum_dz.unsqueeze(2) * inv_n - xhat * sum_dz_xhat.unsqueeze(2) * inv_n);
  const auto affine_grad = [&](const at::Tensor& param, const at::Tensor& sums) {
    return param.defined() ? sums.sum(0).to(x.scalar_type()) : at::Tensor();
  };
  return {from_bcs(dx, x, s), affine_grad(weight, sum_dz_xhat), affine_grad(bias, sum_dz)};
}

}  // namespace patchgemm
