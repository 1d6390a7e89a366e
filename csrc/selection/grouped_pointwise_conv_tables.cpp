// Grouped pointwise convolution's tables. Forward and grad_input apply a per-group matrix:
//   small_groups     our kernel for channels-first x in groups of at most 128 channels: x streamed
//                    once, each group's matrix on chip (kernels/gemm/small_group_gemm.h); 16-bit,
//                    or fp32 in TF32 where torch.backends.cudnn.allow_tf32 allows, as the conv;
//   strided_batched  our planner's strided-batched GEMM: one over the groups for tokens x, one per
//                    sample for channels-first x (the positions of a sample are contiguous, those
//                    of different samples are not); the bias pre-filled, the GEMMs add onto it;
//   aten_matmul      torch.matmul broadcasting the [G, c_out, c_in] matrix over the samples;
//   aten_conv        F.conv*d(groups = G) by the matrix: the forward itself, and for grad_input the
//                    conv by the weight's per-group transpose (grad_y's channels in, x's out).
// The weight gradient (and the bias gradient where asked): small_groups (the same regime, one pass
// over grad_y and x, the bias gradient in it), strided_batched (per sample, summed in fp32), else
// ATen's einsum; the bias gradient outside small_groups is one sum over the positions.
#include <ATen/ATen.h>


#include "kernels/gemm/gemm.h"
#include "selection/grouped_pointwise_conv_tables.h"
#include "selection/registry.h"

#ifdef PATCHGEMM_PTX_KERNELS
#include "kernels/gemm/small_group_gemm.h"
#endif

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;

// A conv's GEMMs follow a conv's numerics, as the conv they replace.
constexpr GemmConvention kConv = GemmConvention::kConv;

std::string signature(const GroupedPointwiseConvProblem& p) {
  selection::Text out;
  out << "(" << describe("x", p.x) << (p.tokens ? ", tokens" : ", channels-first") << ", "
      << describe("matrix", p.matrix) << (p.bias ? ", bias" : "") << (p.backward_follows ? ", backward follows" : "")
      << ")";
  return out.str();
}

// x [B, G, c_in, L] or [N, G, c_in]: positions per GEMM, groups, the small matrices' sizes.
selection::ProblemFeatures features(bool tokens, const at::Tensor& x, int64_t c_out, bool bias) {
  const double positions = tokens ? double(x.size(0)) : double(x.size(0)) * double(x.size(3));
  return selection::features_on(x, {{"batch", double(x.size(0))}, {"positions", positions},
                                    {"groups", double(x.size(1))}, {"c_in", double(x.size(2))},
                                    {"c_out", double(c_out)}, {"tokens_layout", tokens ? 1.0 : 0.0},
                                    {"bias", bias ? 1.0 : 0.0}});
}

selection::ProblemFeatures apply_features(const GroupedPointwiseConvProblem& p) {
  return features(p.tokens, p.x, p.matrix.size(1), p.bias.has_value());
}

// Where the default choice passes over strided_batched for channels-first x, whose GEMMs run one
// per sample, for torch.matmul's one batched GEMM: 16-bit x on the GPU (H100, BENCHMARKS.md G2; fp32
// and tokens x win there), and the reverse on AVX2 CPUs, where bfloat16 per-sample GEMMs take ATen's
// fast bf16 loop (kernels/gemm/gemm_cpu.cpp; 4x matmul on G2) and fp32 ones lose to matmul's. With
// oneDNN's bf16 GEMMs (AVX-512) matmul's one batched GEMM wins in bfloat16 too (1.8x on G2).
WhyNot per_sample_rule(const GroupedPointwiseConvProblem& p) {
  if (p.tokens) return "";
  if (p.x.is_cpu()) {
    if (p.x.scalar_type() == at::kBFloat16 && !cpu::bf16_gemms_on_onednn()) return "";
    return "rule: on the CPU, torch.matmul's one batched GEMM runs channels-first x faster (in bfloat16: "
           "on oneDNN, AVX-512)";
  }
  if (p.x.element_size() == 2) return "16-bit channels-first x: torch.matmul's one batched GEMM is faster";
  return "";
}

#ifdef PATCHGEMM_PTX_KERNELS
constexpr const char* kSmallGroupConditions =
    "16-bit channels-first x on sm_80+, groups of at most 128 channels in and out, positions per sample % 8 == 0";

// Where the small-group kernels apply; `takes_fp32`: the apply kernel, fp32 in TF32 where allowed.
WhyNot small_groups_apply(const at::Tensor& x, bool tokens, int64_t c_out, int64_t c_in, bool takes_fp32) {
  if (!x.is_cuda()) return "CUDA tensors only";
  if (tokens) return "channels-first x only";
  const auto dtype = x.scalar_type();
  if (dtype == at::kFloat && takes_fp32) {
    if (!tf32_allowed(kConv)) return "fp32 runs in TF32, and torch.backends.cudnn.allow_tf32 is off";
  } else if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return takes_fp32 ? "float32, float16 and bfloat16 only" : "16-bit dtypes only";
  }
  return c_out > 128 || c_in > 128 ? "groups of at most 128 channels in and out only" : WhyNot();
}

Candidate<GroupedPointwiseConvProblem, at::Tensor> small_groups() {
  return {"small_groups", "cuda sm_80+",
          "channels-first x on sm_80+, 16-bit or fp32 with TF32 allowed (torch.backends.cudnn.allow_tf32), groups "
          "of at most 128 channels in and out, positions per sample % 8 == 0",
          [](const GroupedPointwiseConvProblem& p) {
            return small_groups_apply(p.x, p.tokens, p.matrix.size(1), p.matrix.size(2), /*takes_fp32=*/true);
          },
          nullptr,
          [](const GroupedPointwiseConvProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
            if (!cuda::small_group_apply(p.matrix, p.x, p.bias, p.out, why)) return std::nullopt;
            return p.out;
          }};
}
#endif

Candidate<GroupedPointwiseConvProblem, at::Tensor> strided_batched() {
  return {"strided_batched", "cpu cuda rocm",
          "our strided-batched GEMM: one for tokens (channels_last) x, one per sample for channels-first x",
          [](const GroupedPointwiseConvProblem&) { return WhyNot(); }, per_sample_rule,
          [](const GroupedPointwiseConvProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
            if (p.tokens) {  // [G, N, c_in] @ [G, c_in, c_out] -> [G, N, c_out]
              run_gemm(p.x.transpose(0, 1), p.matrix.transpose(1, 2), p.out.transpose(0, 1), p.bias, false, kConv);
              return p.out;
            }
            if (p.bias) p.out.copy_(p.bias->view({1, p.bias->size(0), p.bias->size(1), 1}).expand_as(p.out));
            for (int64_t b = 0; b < p.x.size(0); ++b) {  // [G, c_out, c_in] @ [G, c_in, L] -> [G, c_out, L]
              run_gemm(p.matrix, p.x[b], p.out[b], std::nullopt, p.bias.has_value(), kConv);
            }
            return p.out;
          }};
}

// fp32 channels-first x on the CPU: oneDNN's grouped convolution runs a forward alone faster than
// torch.matmul's batched GEMM where each group's product is wide and the problem large (c_out >= 32
// output channels per group, 2^24 multiply-adds or more), and loses 2-4x on small ones. Fitted on
// 40 random forward problems (2-core AVX-512 VM, torch 2.13) and judged on 60 others: there the
// conv ran 9 of the 10 it takes 1.13-1.64x faster (one 0.77x), the choice's mean regret (geomean)
// 1.083 -> 1.042. In a training step (forward + backward, the backward's GEMMs between forwards)
// the conv's forward loses instead: on 60 random problems the rule takes (2-core AMD EPYC VM), the
// step ran 1.05-1.07x slower (geomean) with it than with matmul's, faster on 16 only, while the
// forward alone ran 0.90-0.94x the time. So the rule holds for forwards no backward follows. The
// input gradient's table (always within a step) keeps matmul likewise: its conv, 1.37x faster
// alone on the G2 benchmark's shape, made those steps 1.00-1.04x slower.
WhyNot onednn_grouped_conv_wins_fp32(const GroupedPointwiseConvProblem& p) {
  if (!p.x.is_cpu() || p.tokens || p.x.scalar_type() != at::kFloat || p.backward_follows) return {};
  const int64_t c_out = p.matrix.size(1), c_in = p.matrix.size(2);
  const double macs = double(p.x.size(0)) * double(p.x.size(1)) * double(c_in) * double(c_out) * double(p.x.size(3));
  if (c_out < 32 || macs < double(1 << 24)) return {};
  return "rule: fp32 channels-first x on the CPU, c_out >= 32 and 2^24 multiply-adds or more, and no backward "
         "following, runs faster on oneDNN's grouped convolution";
}

// `forward`: the forward's table (its rule may pass matmul over for aten_conv).
Candidate<GroupedPointwiseConvProblem, at::Tensor> aten_matmul(bool forward) {
  return {"aten_matmul", "cpu cuda rocm", "any problem: torch.matmul broadcasting the per-group matrix",
          [](const GroupedPointwiseConvProblem& p) {  // [G, c_out, c_in] @ [B, G, c_in, L], or one row per token
            const int64_t c_out = p.matrix.size(1), c_in = p.matrix.size(2), groups = p.x.size(1);
            return p.tokens ? aten_matmul_sums_unlike_a_conv(p.x, 1, c_out, c_in, p.x.size(0) * groups)
                            : aten_matmul_sums_unlike_a_conv(p.x, c_out, p.x.size(3), c_in, p.x.size(0) * groups);
          },
          [forward](const GroupedPointwiseConvProblem& p) {
            return forward ? onednn_grouped_conv_wins_fp32(p) : WhyNot();
          },
          [](const GroupedPointwiseConvProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
            if (p.tokens) {  // [N, G, 1, c_in] @ [G, c_in, c_out] -> [N, G, 1, c_out]
              at::Tensor y = at::matmul(p.x.unsqueeze(2), p.matrix.transpose(1, 2)).squeeze(2);
              p.out.copy_(p.bias ? y + *p.bias : y);
              return p.out;
            }
            at::Tensor y = at::matmul(p.matrix, p.x);  // [B, G, c_out, L], contiguous
            if (p.bias) y.add_(p.bias->unsqueeze(-1));
            return y.view(p.out_sizes);
          }};
}

// The forward's candidates and the input gradient's: both apply a per-group matrix.
std::vector<Candidate<GroupedPointwiseConvProblem, at::Tensor>> apply_candidates(bool forward) {
  std::vector<Candidate<GroupedPointwiseConvProblem, at::Tensor>> candidates;
#ifdef PATCHGEMM_PTX_KERNELS
  candidates.push_back(small_groups());
#endif
  candidates.push_back(strided_batched());
  candidates.push_back(aten_matmul(forward));
  candidates.push_back(
      {"aten_conv", "cpu cuda rocm", "any problem: F.conv*d with groups (cuDNN / MIOpen / ATen)",
       [](const GroupedPointwiseConvProblem&) { return WhyNot(); }, nullptr,
       [](const GroupedPointwiseConvProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
         const std::optional<at::Tensor> bias = p.bias ? std::optional<at::Tensor>(p.bias->reshape(-1)) : std::nullopt;
         const int64_t rank = p.conv_x.dim() - 2;
         const std::vector<int64_t> ones(rank, 1), zeros(rank, 0);
         std::vector<int64_t> weight_sizes(rank + 2, 1);  // [G * c_out, c_in, 1, ...]
         weight_sizes[0] = p.matrix.size(0) * p.matrix.size(1);
         weight_sizes[1] = p.matrix.size(2);
         const at::Tensor weight = p.matrix.reshape(weight_sizes);  // a copy only for grad_input's transpose
         return at::convolution(p.conv_x, weight, bias, ones, zeros, ones, false, zeros, p.groups);
       }});
  return candidates;
}

const Table<GroupedPointwiseConvProblem, at::Tensor> kForward("grouped_pointwise_conv", apply_candidates(true),
                                                              signature, apply_features);
const Table<GroupedPointwiseConvProblem, at::Tensor> kGradInput("grouped_pointwise_conv_grad_input",
                                                                apply_candidates(false), signature, apply_features);

using Grads = std::tuple<at::Tensor, at::Tensor>;  // (grad_w, grad_b or undefined)

// The bias gradient where the weight-gradient GEMM does not sum it: grad_y summed over positions.
at::Tensor bias_grad(const GroupedPointwiseConvWeightGradProblem& p) {
  if (!p.with_bias) return at::Tensor();
  if (p.tokens) return sum_for_bias_grad(p.grad_y, {0});
  const at::Tensor rows = p.grad_y.view({p.grad_y.size(0), -1, p.grad_y.size(3)});  // [B, C_out, L]
  return sum_for_bias_grad(rows, {0, 2}).view({p.grad_y.size(1), p.grad_y.size(2)});
}

const Table<GroupedPointwiseConvWeightGradProblem, Grads> kGradWeight(
    "grouped_pointwise_conv_grad_weight",
    {
#ifdef PATCHGEMM_PTX_KERNELS
        {"small_groups", "cuda sm_80+", kSmallGroupConditions,
         [](const GroupedPointwiseConvWeightGradProblem& p) {
           return small_groups_apply(p.x, p.tokens, p.grad_y.size(2), p.x.size(2), /*takes_fp32=*/false);
         },
         nullptr,
         [](const GroupedPointwiseConvWeightGradProblem& p, bool, WhyNot& why) -> std::optional<Grads> {
           const int64_t groups = p.x.size(1), c_out = p.grad_y.size(2), c_in = p.x.size(2);
           at::Tensor grad_w = at::empty({groups, c_out, c_in}, p.x.options());
           // The bias gradient in the same pass where a spare column allows (c_in < 128).
           const bool fused = p.with_bias && c_in < 128;
           at::Tensor grad_b = fused ? at::empty({groups, c_out}, p.x.options()) : at::Tensor();
           if (!cuda::small_group_weight_grad(p.grad_y, p.x, grad_w, grad_b, why)) return std::nullopt;
           return Grads{grad_w, fused ? grad_b : bias_grad(p)};
         }},
#endif
        {"strided_batched", "cpu cuda rocm",
         "our strided-batched GEMM: one for tokens x; per sample for channels-first x, summed in fp32 "
         "(16-bit on the CPU: all samples in one, then their sum)",
         [](const GroupedPointwiseConvWeightGradProblem&) { return WhyNot(); }, nullptr,
         [](const GroupedPointwiseConvWeightGradProblem& p, bool, WhyNot&) -> std::optional<Grads> {
           const int64_t groups = p.x.size(1), c_out = p.grad_y.size(2), c_in = p.x.size(2);
           if (p.x.is_cpu() && p.x.element_size() == 2 && !p.tokens && p.x.size(0) > 1) {
             // On the CPU an fp32 output makes the GEMM widen its 16-bit operands first; as torch.matmul
             // does, one GEMM per (sample, group) in 16 bits, summed over samples in fp32.
             const int64_t batch = p.x.size(0), length = p.x.size(3);
             at::Tensor per_sample = at::empty({batch * groups, c_out, c_in}, p.x.options());
             run_gemm(p.grad_y.reshape({batch * groups, c_out, length}),
                      p.x.reshape({batch * groups, c_in, length}).transpose(1, 2), per_sample, std::nullopt, false,
                      kConv);
             const at::Tensor sum = at::sum(per_sample.view({batch, groups, c_out, c_in}), {0}, false, at::kFloat);
             return Grads{sum.to(p.x.scalar_type()), bias_grad(p)};
           }
           at::Tensor grad_w = at::empty({groups, c_out, c_in}, p.x.options());
           if (p.tokens) {  // [G, c_out, N] @ [G, N, c_in]
             run_gemm(p.grad_y.transpose(0, 1).transpose(1, 2), p.x.transpose(0, 1), grad_w, std::nullopt, false,
                      kConv);
             return Grads{grad_w, bias_grad(p)};
           }
           // Per sample [G, c_out, L] @ [G, L, c_in], summed into an fp32 scratch for 16-bit data.
           at::Tensor sum =
               p.x.element_size() == 2 ? at::empty_like(grad_w, grad_w.options().dtype(at::kFloat)) : grad_w;
           if (p.x.size(0) == 0) sum.zero_();
           for (int64_t b = 0; b < p.x.size(0); ++b) {
             run_gemm(p.grad_y[b], p.x[b].transpose(1, 2), sum, std::nullopt, b > 0, kConv);
           }
           if (!sum.is_same(grad_w)) grad_w.copy_(sum);
           return Grads{grad_w, bias_grad(p)};
         }},
        {"aten_einsum", "cpu cuda rocm", "any problem: ATen's einsum over the positions",
         [](const GroupedPointwiseConvWeightGradProblem& p) {  // per group [c_out, positions] @ [positions, c_in]
           const int64_t positions = p.tokens ? p.x.size(0) : p.x.size(0) * p.x.size(3);
           return aten_matmul_sums_unlike_a_conv(p.x, p.grad_y.size(2), p.x.size(2), positions, p.x.size(1));
         },
         nullptr,
         [](const GroupedPointwiseConvWeightGradProblem& p, bool, WhyNot&) -> std::optional<Grads> {
           return Grads{
               p.tokens ? at::einsum("ngo,ngi->goi", {p.grad_y, p.x}) : at::einsum("bgol,bgil->goi", {p.grad_y, p.x}),
               bias_grad(p)};
         }},
    },
    [](const GroupedPointwiseConvWeightGradProblem& p) {
      selection::Text out;
      out << "(" << describe("grad_y", p.grad_y) << ", " << describe("x", p.x) << (p.tokens ? ", tokens" : "")
          << (p.with_bias ? ", with bias" : "") << ")";
      return out.str();
    },
    [](const GroupedPointwiseConvWeightGradProblem& p) {
      return features(p.tokens, p.x, p.grad_y.size(2), p.with_bias);
    });

}  // namespace

at::Tensor select_grouped_pointwise_conv(const GroupedPointwiseConvProblem& p) {
  const std::string op = p.op;
  if (op == "grouped_pointwise_conv") return kForward.run(p);
  TORCH_INTERNAL_ASSERT(op == "grouped_pointwise_conv_grad_input", "no pointwise table for ", op);
  return kGradInput.run(p);
}

std::tuple<at::Tensor, at::Tensor> select_grouped_pointwise_conv_weight_grad(
    const GroupedPointwiseConvWeightGradProblem& p) {
  return kGradWeight.run(p);
}

}  // namespace patchgemm
