// The FP8 tables. quantize_fp8: two fused kernels (amax, then the cast) on NVIDIA GPUs, else ATen's
// ops. scaled_grouped_mm: one cuBLASLt FP8 strided-batched matmul that writes the output in its final
// layout; torch._scaled_mm once per group (a copy into the layout each); the operands dequantized to
// float64 and ATen's bmm -- the CPU's path, and the GPU's where no FP8 GEMM applies.
#include <ATen/ATen.h>

#include <sstream>
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
#include "selection/registry.h"

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;

std::string quantize_signature(const QuantizeProblem& p) {
  std::ostringstream out;
  out << "(" << describe("x", p.x) << " -> " << c10::toString(p.format) << (p.rowwise ? "" : ", no rowwise")
      << (p.transposed ? ", transposed" : "") << ")";
  return out.str();
}

selection::ProblemFeatures quantize_features(const QuantizeProblem& p) {
  return selection::features_on(p.x, {{"numel", double(p.x.numel())}, {"transposed", p.transposed ? 1.0 : 0.0}});
}

const Table<QuantizeProblem, std::tuple<at::Tensor, at::Tensor, at::Tensor>> kQuantize(
    "quantize_fp8",
    {
        {"fused", "cuda",
         "x float32, float16 or bfloat16 on an NVIDIA GPU: amax, then one pass that casts (and transposes "
         "through shared memory)",
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
            WhyNot& why) -> std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> {
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
           cuda::quantize_fp8(p.x, data, data_t, scale);
           const at::Tensor none = at::empty({0}, fp8);
           return std::make_tuple(p.rowwise ? data : none, p.transposed ? data_t : none, scale);
#else
           why = "this build has no CUDA kernels";
           return std::nullopt;
#endif
         }},
        {"aten", "cpu cuda rocm", "any x: ATen's abs, max, division, clamp and cast; a copy transposes",
         [](const QuantizeProblem&) { return WhyNot(); }, nullptr,
         [](const QuantizeProblem& p, bool, WhyNot&) -> std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> {
           Quantized q = quantize_fp8_aten(p.x, p.format, p.rowwise, p.transposed);
           return std::make_tuple(q.data, q.data_t, q.scale);
         }},
    },
    quantize_signature, quantize_features);

std::string gemm_signature(const ScaledGroupedProblem& p) {
  std::ostringstream out;
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
WhyNot needs_fp8_gpu(const ScaledGroupedProblem& p) {
  if (!p.a.is_cuda()) return "CUDA tensors only";
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(p.a.get_device());
  if (props->major * 10 + props->minor < 89) return "FP8 matmuls need sm_89 or newer";
  return {};
}
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
         needs_fp8_gpu, nullptr,
         [](const ScaledGroupedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           why = cuda::run_scaled_gemm_lt(p.a, p.b, p.scale_a, p.scale_b, p.c, p.bias, p.fast_accum);
           if (!why.empty()) return std::nullopt;
           return p.out;
         }},
        {"aten_scaled_mm", "cuda sm_89+", "torch._scaled_mm once per group, each result copied into the layout",
         needs_fp8_gpu, nullptr,
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

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> select_quantize_fp8(const QuantizeProblem& p) {
  return kQuantize.run(p);
}
at::Tensor select_scaled_grouped_mm(const ScaledGroupedProblem& p) { return kScaledGroupedMm.run(p); }

}  // namespace patchgemm
