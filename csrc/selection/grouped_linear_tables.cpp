// The grouped-linear ops' implementation table: our one strided-batched GEMM over the groups, which
// writes the output in its final layout, else ATen's bmm / baddbmm over the same views (plus a copy
// into the op's layout); on CUDA also cuBLASLt with each of the first algorithms its heuristic
// proposes, for autotune to time. All follow torch.backends.cuda.matmul.allow_tf32, as nn.Linear does.
#include <ATen/ATen.h>

#include <string>

#include "kernels/gemm/gemm.h"
#include "selection/grouped_linear_tables.h"
#include "selection/registry.h"

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;

std::string signature(const GroupedProblem& p) {
  selection::Text out;
  out << "(" << describe("a", p.a) << ", " << describe("b", p.b) << (p.bias ? ", bias" : "") << ")";
  return out.str();
}

// c_g [M, N] = a_g [M, K] @ b_g [K, N] over G groups, and which operands are transposed in memory.
selection::ProblemFeatures features(const GroupedProblem& p) {
  return selection::features_on(p.a, {{"groups", double(p.a.size(0))},
                                      {"m", double(p.a.size(1))},
                                      {"k", double(p.a.size(2))},
                                      {"n", double(p.b.size(2))},
                                      {"bias", p.bias ? 1.0 : 0.0},
                                      {"a_rows_contiguous", p.a.stride(2) == 1 ? 1.0 : 0.0},
                                      {"b_rows_contiguous", p.b.stride(2) == 1 ? 1.0 : 0.0}});
}

#ifdef PATCHGEMM_WITH_CUDA
// (hipBLASLt is not wired up: CUDA only.)
#ifndef USE_ROCM
// The k-th (1-based) algorithm cuBLASLt's heuristic proposes for the problem's one strided-batched
// call, bias in the epilogue. Never the default choice (strided_batched comes first and always
// applies): autotune times them, so a problem whose usual kernel is slow gets another.
Candidate<GroupedProblem, at::Tensor> cublaslt_algorithm(int k) {
  return {"cublaslt_algo" + std::to_string(k), "cuda",
          "one cuBLASLt strided-batched matmul with the algorithm its heuristic ranks " + std::to_string(k) +
              "; float32, float16, bfloat16; timed by autotune",
          [](const GroupedProblem& p) -> WhyNot {
            if (!p.a.is_cuda()) return "CUDA tensors only";
            if (p.a.scalar_type() == at::kDouble) return "float64 (cuBLASLt's algorithms are not tuned for it)";
            return {};
          },
          nullptr,
          [k](const GroupedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
            why = run_gemm_lt(p.a, p.b, p.c, p.bias, k - 1);
            if (!why.empty()) return std::nullopt;
            return p.out;
          }};
}
#endif  // USE_ROCM
#endif

std::vector<Candidate<GroupedProblem, at::Tensor>> candidates() {
  return {
      {"strided_batched", "cpu cuda rocm", "any problem: one cuBLAS / hipBLAS strided-batched GEMM (guarded "
                                           "against cuBLAS's split-K tail loss)",
       [](const GroupedProblem&) { return WhyNot(); },
       // On the CPU both run ATen's bmm; with a bias, baddbmm adds it in the product, where the
       // planned call adds the product onto a bias written first (one more pass over the output).
       // Not in bfloat16: there the planned call lays the operands out for ATen's fast bf16 loop
       // (kernels/gemm/gemm_cpu.cpp), which more than pays for the pass.
       [](const GroupedProblem& p) -> WhyNot {
         if (p.a.device().is_cpu() && p.bias && p.a.scalar_type() != at::kBFloat16) {
           return "rule: on the CPU, ATen's baddbmm adds the bias in the product";
         }
         return {};
       },
       [](const GroupedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
         run_gemm(p.a, p.b, p.c, p.bias);
         return p.out;
       }},
      {"aten_bmm", "cpu cuda rocm", "any problem: ATen's bmm / baddbmm, then a copy into the output's layout",
       [](const GroupedProblem&) { return WhyNot(); },
       nullptr,
       [](const GroupedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
         p.c.copy_(p.bias ? at::baddbmm(p.bias->unsqueeze(1), p.a, p.b) : at::bmm(p.a, p.b));
         return p.out;
       }},
#ifdef PATCHGEMM_WITH_CUDA
#ifndef USE_ROCM
      cublaslt_algorithm(1), cublaslt_algorithm(2), cublaslt_algorithm(3), cublaslt_algorithm(4),
#endif
#endif
  };
}

const Table<GroupedProblem, at::Tensor> kForward("grouped_linear", candidates(), signature, features);
const Table<GroupedProblem, at::Tensor> kGradInput("grouped_linear_grad_input", candidates(), signature, features);
const Table<GroupedProblem, at::Tensor> kGradWeight("grouped_linear_grad_weight", candidates(), signature, features);

}  // namespace

at::Tensor select_grouped_gemm(const GroupedProblem& p) {
  const std::string op = p.op;
  if (op == "grouped_linear") return kForward.run(p);
  if (op == "grouped_linear_grad_input") return kGradInput.run(p);
  TORCH_INTERNAL_ASSERT(op == "grouped_linear_grad_weight", "no grouped table for ", op);
  return kGradWeight.run(p);
}

}  // namespace patchgemm
