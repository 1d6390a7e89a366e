// The SwiGLU tables, forward and backward: one fused pass (CUDA, ROCm, and CPUs with AVX2), else
// ATen's composite (chunk, silu, mul: three passes and two temporaries).
#include <ATen/ATen.h>


#include "kernels/swiglu/swiglu.h"
#include "selection/swiglu_tables.h"
#include "selection/registry.h"

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;

std::string signature(const SwigluProblem& p) {
  selection::Text out;
  out << "(" << describe("gate_up", p.gate_up) << ")";
  return out.str();
}

selection::ProblemFeatures features(const SwigluProblem& p) {
  const int64_t width = p.gate_up.size(-1);
  return selection::features_on(p.gate_up, {{"rows", double(width ? p.gate_up.numel() / width : 0)},
                                            {"hidden", double(width / 2)}});
}

at::Tensor half_shaped(const at::Tensor& gate_up) {
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  return at::empty(sizes, gate_up.options());
}

WhyNot fused_supports(const SwigluProblem& p) {
  if (p.gate_up.is_cpu()) return "";
#ifdef PATCHGEMM_WITH_CUDA
  if (p.gate_up.is_cuda()) return "";
#endif
  return "gate_up is on " + p.gate_up.device().str() + ", which this build has no kernel for";
}

// On the CPU the fused float32 and 16-bit loops are vectorized where the machine has AVX2 (x86-64)
// and then beat ATen's silu, mul and silu_backward, which each take a pass over memory; compiled for
// the baseline alone (and in float64) they are scalar and lose several times over.
WhyNot fused_rule(const SwigluProblem& p) {
  if (!p.gate_up.is_cpu()) return "";
  if (!swiglu_cpu_is_vectorized())
    return "rule: this CPU lacks AVX2 and FMA, where ATen's vectorized elementwise ops are faster";
  if (p.gate_up.scalar_type() == at::kDouble)
    return "rule: float64 on the CPU runs a scalar loop, where ATen's vectorized elementwise ops are faster";
  return "";
}

const Table<SwigluProblem, at::Tensor> kForward(
    "swiglu",
    {
        {"fused", "cpu cuda rocm", "one pass: reads gate_up, writes h",
         fused_supports, fused_rule,
         [](const SwigluProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           at::Tensor h = half_shaped(p.gate_up);
#ifdef PATCHGEMM_WITH_CUDA
           if (p.gate_up.is_cuda()) {
             cuda::swiglu_into(p.gate_up, h);
             return h;
           }
#endif
           swiglu_cpu(p.gate_up, h);
           return h;
         }},
        {"aten_composite", "cpu cuda rocm", "any problem: ATen's chunk, silu and mul",
         [](const SwigluProblem&) { return WhyNot(); }, nullptr,
         [](const SwigluProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           const auto parts = p.gate_up.chunk(2, -1);
           return at::silu(parts[0]) * parts[1];
         }},
    },
    signature, features);

const Table<SwigluProblem, at::Tensor> kBackward(
    "swiglu_backward",
    {
        {"fused", "cpu cuda rocm", "one pass: reads grad_h and gate_up, writes grad_gate_up",
         fused_supports, fused_rule,
         [](const SwigluProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           at::Tensor grad_gate_up = at::empty_like(p.gate_up);
#ifdef PATCHGEMM_WITH_CUDA
           if (p.gate_up.is_cuda()) {
             cuda::swiglu_backward_into(p.grad_h, p.gate_up, grad_gate_up);
             return grad_gate_up;
           }
#endif
           swiglu_backward_cpu(p.grad_h, p.gate_up, grad_gate_up);
           return grad_gate_up;
         }},
        {"aten_composite", "cpu cuda rocm", "any problem: ATen's silu_backward, silu and mul, as autograd runs them",
         [](const SwigluProblem&) { return WhyNot(); }, nullptr,
         [](const SwigluProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           const auto parts = p.gate_up.chunk(2, -1);
           const at::Tensor &g = parts[0], &u = parts[1];
           return at::cat({at::silu_backward(p.grad_h * u, g), p.grad_h * at::silu(g)}, -1);
         }},
    },
    signature, features);

}  // namespace

at::Tensor select_swiglu(const SwigluProblem& p) { return kForward.run(p); }
at::Tensor select_swiglu_backward(const SwigluProblem& p) { return kBackward.run(p); }

}  // namespace patchgemm
