// instance_norm_act's implementation tables, forward and backward: the fused two-pass CUDA kernels
// (CUDA and ROCm), else ATen's composite (any device).
#include <ATen/ATen.h>


#include "kernels/norm/instance_norm.h"
#include "selection/norm_tables.h"
#include "selection/registry.h"

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;
using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

std::string signature(const at::Tensor& x, const NormShape& s, bool gelu, bool affine) {
  selection::Text out;
  out << "(" << describe("x", x) << (s.tokens ? ", tokens" : ", channels-first")
      << (gelu ? ", gelu" : "") << (affine ? ", affine" : "") << ")";
  return out.str();
}

selection::ProblemFeatures features(const at::Tensor& x, const NormShape& s, bool gelu, bool affine) {
  return selection::features_on(x, {{"batch", double(s.batch)}, {"channels", double(s.channels)},
                                    {"spatial", double(s.spatial)}, {"tokens_layout", s.tokens ? 1.0 : 0.0},
                                    {"gelu", gelu ? 1.0 : 0.0}, {"affine", affine ? 1.0 : 0.0}});
}

#ifdef PATCHGEMM_WITH_CUDA
// The CUDA kernels' grid: tokens problems put the batch on grid.y.
WhyNot fused_supports(const at::Tensor& x, const NormShape& s) {
  if (!x.is_cuda()) return "x is not on a CUDA / ROCm device";
  if (s.tokens && s.batch > 65535) return "tokens layout with batch > 65535 (the kernels' grid)";
  return "";
}
#endif

// ATen's CPU batch norm folds the norm into y = x * a + c (a = rstd * weight), which loses digits
// where a channel barely varies (a huge rstd): few positions per channel go to the composite, whose
// float64 costs nothing there.
WhyNot batch_norm_supports(const at::Tensor& x, const NormShape& s) {
  if (!x.is_cpu()) return "CPU tensors only";
  if (s.spatial < 16) return "under 16 positions per channel";
  return {};
}

const Table<NormProblem, Result> kForward(
    "instance_norm_act",
    {
#ifdef PATCHGEMM_WITH_CUDA
        {"fused_two_pass", "cuda rocm", "one kernel for the statistics, one to normalize + activate",
         [](const NormProblem& p) { return fused_supports(p.x, p.s); },
         nullptr,
         [](const NormProblem& p, bool, WhyNot&) -> std::optional<Result> {
           const auto acc = p.x.options().dtype(norm_acc_dtype(p.x));
           at::Tensor y = at::empty_like(p.x, at::MemoryFormat::Contiguous);
           at::Tensor mean = at::empty({p.s.batch, p.s.channels}, acc), rstd = at::empty_like(mean);
           cuda::instance_norm_act_forward(p.x, p.weight, p.bias, p.eps, p.gelu, p.s, y, mean, rstd);
           return Result{y, mean, rstd};
         }},
#endif
        {"aten_batch_norm", "cpu", "ATen's batch norm over [1, B * C, S] (as its instance_norm runs), then its gelu",
         [](const NormProblem& p) { return batch_norm_supports(p.x, p.s); },
         nullptr,
         [](const NormProblem& p, bool, WhyNot&) -> std::optional<Result> {
           return instance_norm_act_batch_norm(p.x, p.weight, p.bias, p.eps, p.gelu, p.s);
         }},
        {"aten_composite", "cpu cuda rocm", "any problem: ATen's mean / var / affine / gelu",
         [](const NormProblem&) { return WhyNot(); },
         nullptr,
         [](const NormProblem& p, bool, WhyNot&) -> std::optional<Result> {
           return instance_norm_act_aten(p.x, p.weight, p.bias, p.eps, p.gelu, p.s);
         }},
    },
    [](const NormProblem& p) { return signature(p.x, p.s, p.gelu, p.weight.defined()); },
    [](const NormProblem& p) { return features(p.x, p.s, p.gelu, p.weight.defined()); });

const Table<NormBackwardProblem, Result> kBackward(
    "instance_norm_act_backward",
    {
#ifdef PATCHGEMM_WITH_CUDA
        {"fused_two_pass", "cuda rocm", "one kernel for the per-channel sums, one for grad_x, dweight, dbias",
         [](const NormBackwardProblem& p) { return fused_supports(p.x, p.s); },
         nullptr,
         [](const NormBackwardProblem& p, bool, WhyNot&) -> std::optional<Result> {
           at::Tensor grad_x = at::empty_like(p.x, at::MemoryFormat::Contiguous);
           const auto affine_grad = [&](const at::Tensor& param) {
             return param.defined() ? at::empty({p.s.channels}, p.x.options()) : at::Tensor();
           };
           at::Tensor grad_w = affine_grad(p.weight), grad_b = affine_grad(p.bias);
           cuda::instance_norm_act_backward(p.grad_y, p.x, p.weight, p.bias, p.mean, p.rstd, p.gelu, p.s,
                                            grad_x, grad_w, grad_b);
           return Result{grad_x, grad_w, grad_b};
         }},
#endif
        {"aten_batch_norm", "cpu", "ATen's batch norm backward over [1, B * C, S], GELU's gradient before it",
         [](const NormBackwardProblem& p) { return batch_norm_supports(p.x, p.s); },
         nullptr,
         [](const NormBackwardProblem& p, bool, WhyNot&) -> std::optional<Result> {
           return instance_norm_act_backward_batch_norm(p.grad_y, p.x, p.weight, p.bias, p.mean, p.rstd, p.gelu,
                                                        p.s);
         }},
        {"aten_composite", "cpu cuda rocm", "any problem: ATen's composite backward",
         [](const NormBackwardProblem&) { return WhyNot(); },
         nullptr,
         [](const NormBackwardProblem& p, bool, WhyNot&) -> std::optional<Result> {
           return instance_norm_act_backward_aten(p.grad_y, p.x, p.weight, p.bias, p.mean, p.rstd, p.gelu, p.s);
         }},
    },
    [](const NormBackwardProblem& p) { return signature(p.x, p.s, p.gelu, p.weight.defined()); },
    [](const NormBackwardProblem& p) { return features(p.x, p.s, p.gelu, p.weight.defined()); });

}  // namespace

Result select_instance_norm_act(const NormProblem& p) { return kForward.run(p); }
Result select_instance_norm_act_backward(const NormBackwardProblem& p) { return kBackward.run(p); }

}  // namespace patchgemm
