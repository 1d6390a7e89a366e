// The FP8 tables. quantize_fp8: two fused kernels (amax, then the cast; delayed scaling: the cast
// alone) on NVIDIA GPUs, else ATen's ops. scaled_grouped_mm: one cuBLASLt FP8 strided-batched matmul
// that writes the output in its final layout; torch._scaled_mm once per group (a copy into the
// layout each); the operands dequantized to float64 and ATen's bmm -- the CPU's path, and the GPU's
// where no FP8 GEMM applies. scaled_ragged_mm: torch._scaled_grouped_mm (no host sync), cuBLASLt per
// group, the operands upcast for ragged_grouped_linear's sync-free kernels (where a sync is
// forbidden), or dequantized per group.
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#ifdef PATCHGEMM_WITH_CUDA
#ifndef USE_ROCM
#include <ATen/cuda/CUDAContext.h>
#endif
#endif

#include "kernels/gemm/gemm.h"
#include "kernels/quant/fp8.h"
#include "problems/fp8.h"
#include "selection/fp8_tables.h"
#include "selection/ragged_tables.h"
#include "selection/registry.h"

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;

std::string quantize_signature(const QuantizeProblem& p) {
  selection::Text out;
  out << "(" << describe("x", p.x) << " -> " << c10::toString(p.format) << (p.rowwise ? "" : ", no rowwise")
      << (p.transposed ? ", transposed" : "") << (p.column_sums ? ", column sums" : "")
      << (p.amax_state.defined() ? ", delayed" : "") << ")";
  return out.str();
}

selection::ProblemFeatures quantize_features(const QuantizeProblem& p) {
  return selection::features_on(p.x, {{"numel", double(p.x.numel())}, {"transposed", p.transposed ? 1.0 : 0.0}});
}

const Table<QuantizeProblem, QuantizeOutputs> kQuantize(
    "quantize_fp8",
    {
        {"fused", "cuda",
         "x float32, float16 or bfloat16 on an NVIDIA GPU: amax, then one pass that casts (and transposes "
         "through shared memory, summing the columns); delayed scaling: that pass alone, observing the amax",
         [](const QuantizeProblem& p) -> WhyNot {
#if defined(PATCHGEMM_WITH_CUDA) && !defined(USE_ROCM)
           if (!p.x.is_cuda()) return "CUDA tensors only";
           if (p.x.scalar_type() == at::kDouble) return "float64 x";
           return {};
#else
           return "this build has no CUDA kernels";
#endif
         },
         nullptr,
         [](const QuantizeProblem& p, bool,
            WhyNot& why) -> std::optional<QuantizeOutputs> {
#if defined(PATCHGEMM_WITH_CUDA) && !defined(USE_ROCM)
           if (reinterpret_cast<uintptr_t>(p.x.const_data_ptr()) % 16 != 0) {
             why = "x not 16-byte aligned";
             return std::nullopt;
           }
           const at::TensorOptions fp8 = p.x.options().dtype(p.format);
           std::vector<int64_t> swapped = p.x.sizes().vec();
           if (p.transposed) std::swap(swapped[swapped.size() - 1], swapped[swapped.size() - 2]);
           at::Tensor data = p.rowwise ? at::empty(p.x.sizes(), fp8) : at::Tensor();
           at::Tensor data_t = p.transposed ? at::empty(swapped, fp8) : at::Tensor();
           at::Tensor scale = at::empty({}, p.x.options().dtype(at::kFloat));
           std::vector<int64_t> summed = p.x.sizes().vec();
           if (p.column_sums) summed.erase(summed.end() - 2);
           at::Tensor sums = p.column_sums ? at::empty(summed, p.x.options()) : at::Tensor();
           cuda::quantize_fp8_into(p.x, data, data_t, scale, sums, p.amax_state);
           const at::Tensor none = at::empty({0}, fp8);
           return std::make_tuple(p.rowwise ? data : none, p.transposed ? data_t : none, scale,
                                  p.column_sums ? sums : at::empty({0}, p.x.options()));
#else
           why = "this build has no CUDA kernels";
           return std::nullopt;
#endif
         }},
        {"aten", "cpu cuda rocm", "any x: ATen's abs, max, division, clamp and cast; a copy transposes, a sum sums",
         [](const QuantizeProblem&) { return WhyNot(); }, nullptr,
         [](const QuantizeProblem& p, bool, WhyNot&) -> std::optional<QuantizeOutputs> {
           Quantized q = quantize_fp8_aten(p.x, p.format, p.rowwise, p.transposed, p.column_sums, p.amax_state);
           return std::make_tuple(q.data, q.data_t, q.scale, q.sums);
         }},
    },
    quantize_signature, quantize_features);

std::string gemm_signature(const ScaledGroupedProblem& p) {
  selection::Text out;
  out << "(" << describe("a", p.a) << ", " << describe("b", p.b) << (p.bias ? ", bias" : "") << " -> "
      << c10::toString(p.out.scalar_type()) << (p.fast_accum ? ", fast_accum" : "") << ")";
  return out.str();
}

selection::ProblemFeatures gemm_features(const ScaledGroupedProblem& p) {
  return selection::features_on(p.out, {{"groups", double(p.a.size(0))}, {"m", double(p.a.size(1))},
                                        {"k", double(p.a.size(2))}, {"n", double(p.b.size(1))},
                                        {"bias", p.bias ? 1.0 : 0.0}});
}

#ifdef PATCHGEMM_WITH_CUDA
#ifndef USE_ROCM
// FP8 tensor cores: Ada and Hopper (sm_89, sm_90) and newer.
WhyNot needs_fp8_gpu(const at::Tensor& a) {
  if (!a.is_cuda()) return "CUDA tensors only";
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(a.get_device());
  if (props->major * 10 + props->minor < 89) return "FP8 matmuls need sm_89 or newer";
  return {};
}
WhyNot grouped_needs_fp8_gpu(const ScaledGroupedProblem& p) { return needs_fp8_gpu(p.a); }
#endif  // USE_ROCM
#endif

const Table<ScaledGroupedProblem, at::Tensor> kScaledGroupedMm(
    "scaled_grouped_mm",
    {
#ifdef PATCHGEMM_WITH_CUDA
#ifndef USE_ROCM
        {"cublaslt_fp8", "cuda sm_89+",
         "one cuBLASLt FP8 strided-batched matmul writing the final layout; K, leading dimensions and batch "
         "strides multiples of 16 bytes",
         grouped_needs_fp8_gpu, nullptr,
         [](const ScaledGroupedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           why = cuda::run_scaled_gemm_lt(p.a, p.b, p.scale_a, p.scale_b, p.c, p.bias, p.fast_accum);
           if (!why.empty()) return std::nullopt;
           return p.out;
         }},
        {"aten_scaled_mm", "cuda sm_89+", "torch._scaled_mm once per group, each result copied into the layout",
         grouped_needs_fp8_gpu, nullptr,
         [](const ScaledGroupedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           const int64_t k = p.a.size(2), n = p.b.size(1);
           if (k % 16 != 0 || n % 16 != 0 || p.a.stride(2) != 1 || p.b.stride(2) != 1) {
             why = "torch._scaled_mm needs K and N multiples of 16 and K-contiguous operands";
             return std::nullopt;
           }
           for (int64_t g = 0; g < p.a.size(0); ++g) {
             p.c[g].copy_(at::_scaled_mm(p.a[g], p.b[g].t(), p.scale_a, p.scale_b, std::nullopt, std::nullopt,
                                         p.out.scalar_type(), p.fast_accum));
           }
           if (p.bias) p.c.add_(p.bias->unsqueeze(1));
           return p.out;
         }},
#endif  // USE_ROCM
#endif
        {"dequantized_bmm", "cpu cuda rocm",
         "any problem: the operands dequantized to float64 (exactly), ATen's bmm, one rounding into the output",
         [](const ScaledGroupedProblem&) { return WhyNot(); }, nullptr,
         [](const ScaledGroupedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           const at::Tensor a = p.a.to(at::kDouble) * p.scale_a.to(at::kDouble);
           const at::Tensor b = p.b.to(at::kDouble) * p.scale_b.to(at::kDouble);
           p.c.copy_(p.bias ? at::baddbmm(p.bias->to(at::kDouble).unsqueeze(1), a, b.transpose(1, 2))
                            : at::bmm(a, b.transpose(1, 2)));
           return p.out;
         }},
    },
    gemm_signature, gemm_features);

std::string ragged_signature(const ScaledRaggedProblem& p) {
  selection::Text out;
  out << "(" << describe("a", p.a) << ", " << describe("b", p.b) << (p.bias ? ", bias" : "") << ", " << p.b.size(0)
      << " ragged groups -> " << c10::toString(p.out_dtype) << (p.fast_accum ? ", fast_accum" : "") << ")";
  return out.str();
}

selection::ProblemFeatures ragged_features(const ScaledRaggedProblem& p) {
  return selection::features_on(p.a, {{"groups", double(p.b.size(0))},
                                      {"rows", double(p.a.size(0))},
                                      {"k", double(p.a.size(1))},
                                      {"n", double(p.b.size(1))},
                                      {"bias", p.bias ? 1.0 : 0.0}});
}

at::Tensor empty_rows(const ScaledRaggedProblem& p) {
  return at::empty({p.a.size(0), p.b.size(1)}, p.a.options().dtype(p.out_dtype));
}

const Table<ScaledRaggedProblem, at::Tensor> kScaledRaggedMm(
    "scaled_ragged_mm",
    {
#ifdef PATCHGEMM_WITH_CUDA
#ifndef USE_ROCM
        {"aten_scaled_grouped_mm", "cuda sm_90",
         "torch._scaled_grouped_mm: e4m3 operands, bfloat16 output, K and Nc multiples of 16; offsets read on the "
         "device (no host sync)",
         [](const ScaledRaggedProblem& p) -> WhyNot {
           if (!p.a.is_cuda()) return "CUDA tensors only";
           if (at::cuda::getDeviceProperties(p.a.get_device())->major < 9) return "it needs sm_90 or newer";
           if (p.a.scalar_type() != at::kFloat8_e4m3fn || p.b.scalar_type() != at::kFloat8_e4m3fn)
             return "it takes e4m3 operands only";
           if (p.out_dtype != at::kBFloat16) return "it writes bfloat16 only";
           if (p.a.size(1) % 16 || p.b.size(1) % 16) return "K and Nc must be multiples of 16";
           if (p.a.size(0) == 0) return "no rows";
           return ragged_offsets_reach_device(p.offsets, p.a);
         },
         nullptr,
         [](const ScaledRaggedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           at::Tensor offsets = p.offsets.to(at::kInt);
           // (from pinned host memory the copy does not wait for the GPU)
           if (offsets.is_cpu()) offsets = offsets.pin_memory().to(p.a.device(), /*non_blocking=*/true);
           const int64_t rows = p.a.size(0), groups = p.b.size(0), n = p.b.size(1);
           // Its scales are row-wise: the per-tensor ones repeated over a's rows and b's [G, Nc].
           at::Tensor out = at::_scaled_grouped_mm(p.a, p.b.transpose(1, 2), p.scale_a.expand({rows}).contiguous(),
                                                   p.scale_b.expand({groups, n}).contiguous(), offsets, std::nullopt,
                                                   std::nullopt, at::kBFloat16, p.fast_accum);
           if (p.bias) out.add_(p.bias->repeat_interleave(ragged_sizes(p.offsets, p.a.device()), 0, rows));
           return out;
         }},
        {"cublaslt_fp8_loop", "cuda sm_89+",
         "one cuBLASLt FP8 matmul per non-empty group (scaled_grouped_mm's); sizes read on the host",
         [](const ScaledRaggedProblem& p) -> WhyNot {
           WhyNot why = needs_fp8_gpu(p.a);
           return why.empty() ? ragged_host_sizes_allowed(p.offsets) : why;
         },
         nullptr,
         [](const ScaledRaggedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           const std::vector<int64_t> bounds = ragged_bounds("scaled_ragged_mm", p.offsets, p.a.size(0));
           at::Tensor out = empty_rows(p);
           for (int64_t g = 0; g + 1 < static_cast<int64_t>(bounds.size()); ++g) {
             if (bounds[g + 1] == bounds[g]) continue;
             std::optional<at::Tensor> bias;
             if (p.bias) bias = (*p.bias)[g].unsqueeze(0);
             why = cuda::run_scaled_gemm_lt(p.a.slice(0, bounds[g], bounds[g + 1]).unsqueeze(0), p.b[g].unsqueeze(0),
                                            p.scale_a, p.scale_b, out.slice(0, bounds[g], bounds[g + 1]).unsqueeze(0),
                                            bias, p.fast_accum);
             if (!why.empty()) return std::nullopt;
           }
           return out;
         }},
#endif  // USE_ROCM
        {"upcast_on_gpu", "cuda rocm",
         "the operands cast on the GPU to the output dtype (b exactly, a times both scales), then "
         "ragged_grouped_linear's table, whose kernels read the offsets on the device: no host sync, any "
         "format and output dtype, at the output dtype's GEMM rate",
         [](const ScaledRaggedProblem& p) -> WhyNot {
           if (!p.a.is_cuda()) return "GPU tensors only";
           return ragged_offsets_reach_device(p.offsets, p.a);
         },
         // Slower than an FP8 GEMM: the path where a sync is forbidden and those decline.
         [](const ScaledRaggedProblem& p) { return ragged_only_where_sync_forbidden(p.offsets); },
         [](const ScaledRaggedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           // Every e4m3 and e5m2 value is exact in bfloat16, float16 and float32; the scales are folded
           // into a (one rounding per element) so that float16 sums stay in the output's range.
           RaggedProblem upcast;
           upcast.op = "ragged_grouped_linear";
           upcast.a = (p.a.to(at::kFloat) * (p.scale_a * p.scale_b)).to(p.out_dtype);
           upcast.b = p.b.to(p.out_dtype).transpose(1, 2);
           upcast.bias = p.bias;
           upcast.offsets = p.offsets;
           upcast.groups = p.b.size(0);
           return select_ragged_gemm(upcast);
         }},
#endif
        {"dequantized_loop", "cpu cuda rocm",
         "any problem: the operands dequantized to float64 (exactly), one ATen matmul per group, one rounding "
         "into the output; sizes read on the host",
         [](const ScaledRaggedProblem& p) { return ragged_host_sizes_allowed(p.offsets); }, nullptr,
         [](const ScaledRaggedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           const std::vector<int64_t> bounds = ragged_bounds("scaled_ragged_mm", p.offsets, p.a.size(0));
           const at::Tensor a = p.a.to(at::kDouble) * p.scale_a.to(at::kDouble);
           const at::Tensor b = p.b.to(at::kDouble) * p.scale_b.to(at::kDouble);
           at::Tensor out = empty_rows(p);
           for (int64_t g = 0; g + 1 < static_cast<int64_t>(bounds.size()); ++g) {
             at::Tensor y = at::mm(a.slice(0, bounds[g], bounds[g + 1]), b[g].t());
             if (p.bias) y.add_((*p.bias)[g].to(at::kDouble));
             out.slice(0, bounds[g], bounds[g + 1]).copy_(y);
           }
           return out;
         }},
    },
    ragged_signature, ragged_features);

}  // namespace

QuantizeOutputs select_quantize_fp8(const QuantizeProblem& p) {
  return kQuantize.run(p);
}
at::Tensor select_scaled_grouped_mm(const ScaledGroupedProblem& p) { return kScaledGroupedMm.run(p); }
at::Tensor select_scaled_ragged_mm(const ScaledRaggedProblem& p) { return kScaledRaggedMm.run(p); }

}  // namespace patchgemm
