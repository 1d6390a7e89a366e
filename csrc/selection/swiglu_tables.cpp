// The SwiGLU tables, forward and backward: one fused pass (CUDA and ROCm; the CPU when forced), else
// ATen's composite (chunk, silu, mul: three passes and two temporaries).
#include <ATen/ATen.h>

#include <sstream>

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
  std::ostringstream out;
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

// The CPU loop is scalar (std::exp per element): ATen's vectorized silu, silu_backward and mul beat
// it several times over, so on the CPU the fused candidate runs only when forced.
WhyNot fused_rule(const SwigluProblem& p) {
  return p.gate_up.is_cpu() ? "rule: on the CPU, ATen's vectorized elementwise ops are faster" : "";
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
