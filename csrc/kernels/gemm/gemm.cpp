#include "kernels/gemm/gemm.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace patchgemm {

MatrixView matrix_view(const at::Tensor& t3) {
  return {t3.size(1), t3.size(2), t3.stride(1), t3.stride(2), t3.stride(0)};
}

bool tf32_allowed(GemmConvention convention) {
  const auto& ctx = at::globalContext();
  return convention == GemmConvention::kConv ? ctx.allowTF32CuDNN(at::Float32Op::CONV) : ctx.allowTF32CuBLAS();
}

namespace {
// torch's flag is a bool in older releases and an enum in newer ones.
template <typename Option>
bool allows_reduced_precision(Option option) {
  if constexpr (std::is_same_v<Option, bool>) {
    return option;
  } else {
    return option == Option::AllowReducedPrecisionWithSplitK;
  }
}
}  // namespace

bool matmul_reduced_precision_allowed(at::ScalarType dtype) {
  const auto& ctx = at::globalContext();
  if (dtype == at::kHalf) return allows_reduced_precision(ctx.allowFP16ReductionCuBLAS());
  if (dtype == at::kBFloat16) return allows_reduced_precision(ctx.allowBF16ReductionCuBLAS());
  return false;
}

GemmMath gemm_math(GemmConvention convention, at::ScalarType dtype) {
  return {tf32_allowed(convention),
          convention == GemmConvention::kMatmul && matmul_reduced_precision_allowed(dtype)};
}

std::string aten_matmul_sums_unlike_a_conv(const at::Tensor& input, int64_t m, int64_t n, int64_t k, int64_t batch) {
#ifdef PATCHGEMM_WITH_CUDA
  if (!input.is_cuda() || !matmul_reduced_precision_allowed(input.scalar_type())) return {};
  if (!cuda::split_k_guard(input).invites_split_k(m, n, k, batch)) return {};
  return "16-bit, a long reduction into few output tiles: ATen's matmul may round split-K partial sums to 16 bits "
         "(torch.backends.cuda.matmul.allow_" + std::string(input.scalar_type() == at::kHalf ? "fp16" : "bf16") +
         "_reduced_precision_reduction), where the conv sums in fp32";
#else
  (void)input, (void)m, (void)n, (void)k, (void)batch;
  return {};
#endif
}

namespace {

// a and b as BLAS can read them, and the calls that compute c.
struct PlannedGemm {
  at::Tensor a, b;
  BlasPlan plan;
};

PlannedGemm plan_gemm(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& c) {
  // NOTE: the only copies this library makes of a GEMM input: strides that no leading dimension
  // can describe (e.g. both inner strides > 1, or overlapping rows).
  const LayoutVerdict verdict = check_blas_layout({a_in.size(0), matrix_view(a_in),
                                                   matrix_view(b_in), matrix_view(c)});
  TORCH_INTERNAL_ASSERT(verdict.c_ok, "run_gemm: output must have unit column stride");
  PlannedGemm planned{verdict.a_ok ? a_in : a_in.contiguous(), verdict.b_ok ? b_in : b_in.contiguous(), {}};
  const at::Tensor &a = planned.a, &b = planned.b;
  const GemmProblem problem{a.size(0), matrix_view(a), matrix_view(b), matrix_view(c)};
  SplitKGuard guard;
#ifdef PATCHGEMM_WITH_CUDA
  if (c.is_cuda()) guard = cuda::split_k_guard(a);  // a's dtype: c may be the fp32 scratch below
#endif
  planned.plan = plan_blas_calls(problem, blas_int_limit(), guard);
  TORCH_CHECK(planned.plan.error.empty(), "patchgemm: cannot run the GEMM ", a.sizes(), " x ", b.sizes(),
              " -> ", c.sizes(), ": ", planned.plan.error);
  return planned;
}

// Whether a 16-bit GEMM whose partial sums must stay in fp32 (gemm_math) writes an fp32 scratch:
// where its shape invites split-K and its output fills under half a wave of tiles. cuBLAS told to
// keep 16-bit split-K sums in fp32 runs such a reduction unsplit on a few CTAs (x [1, 512, 512, 112]
// into E = 3 by 16 x 16 patches: 164 times slower), while into an fp32 output it splits K freely,
// its sums already fp32; c is rounded from the scratch once. Larger outputs keep most SMs busy
// unsplit, and there the scratch's traffic would cost more than splitting saves.
bool fp32_sums_want_fp32_output(const at::Tensor& a, const at::Tensor& c, GemmConvention convention) {
#ifdef PATCHGEMM_WITH_CUDA
  if (!c.is_cuda() || gemm_math(convention, a.scalar_type()).reduced_precision_sums) return false;
  const SplitKGuard guard = cuda::split_k_guard(a);
  return guard.invites_split_k(c.size(1), c.size(2), a.size(2), c.size(0)) &&
         guard.under_half_a_wave(c.size(1), c.size(2), c.size(0));
#else
  (void)a, (void)c, (void)convention;
  return false;
#endif
}

void check_gemm_arguments(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                          const std::optional<at::Tensor>& bias, bool accumulate) {
  TORCH_INTERNAL_ASSERT(a.dim() == 3 && b.dim() == 3 && c.dim() == 3);
  TORCH_INTERNAL_ASSERT(!(bias && accumulate));
  TORCH_INTERNAL_ASSERT(a.size(1) == c.size(1) && b.size(2) == c.size(2) && a.size(2) == b.size(1));
}

}  // namespace

void run_gemm(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& c,
              const std::optional<at::Tensor>& bias, bool accumulate, GemmConvention convention) {
  check_gemm_arguments(a_in, b_in, c, bias, accumulate);
  if (c.numel() == 0) return;
  // Broadcast view of the bias over c's rows: [batch, 1 -> M, N].
  auto bias_rows = [&] { return bias->unsqueeze(1).expand_as(c); };
  if (a_in.size(2) == 0) {  // empty sum: c is the bias, or zeros (or unchanged)
    if (accumulate) return;
    bias ? c.copy_(bias_rows()) : c.zero_();
    return;
  }

  const PlannedGemm planned = plan_gemm(a_in, b_in, c);
  const at::Tensor &a = planned.a, &b = planned.b;
  const BlasPlan& plan = planned.plan;
  // Calls that each add a piece of K (the split-K guard, or a K past the integer limit) would round
  // the running sum to a 16-bit c after every piece (a bias gradient whose pieces cancel loses
  // digits): they sum into an fp32 scratch instead, and c is rounded once.
  const bool k_pieces = std::any_of(plan.calls.begin(), plan.calls.end(),
                                    [](const BlasCall& call) { return call.accumulate; });
  if (c.element_size() == 2 && (k_pieces || fp32_sums_want_fp32_output(a, c, convention))) {
#ifdef PATCHGEMM_WITH_CUDA
    // cuBLASLt, its split-K reductions held to fp32 (run_lt_call), writes c directly with the bias in
    // its epilogue where the output fills a wave of small tiles, or where lt_reduction_fits: unsplit
    // there, or split in fp32, it runs faster than the scratch's GEMM plus the scratch's passes (a
    // 16^3 stem's 432 x 768 tokens; k = 7 and 8 patches into 256-2048 tokens and 32-512 channels).
    // On fewer tiles and a longer K it may pick an unsplit kernel (224 x 3 outputs over K = 131072:
    // 200 times slower than the scratch; K = 16384 or more into a few hundred small tiles: slower
    // too), so those keep the scratch.
    if (!k_pieces && !accumulate && plan.calls.size() == 1 &&
        (cuda::lt_reduction_fits(plan.calls[0], a, b, c) ||
         cuda::split_k_guard(a).fills_small_tiles(c.size(1), c.size(2), c.size(0))) &&
        cuda::run_lt_call(plan.calls[0], a, b, c, bias, gemm_math(convention, a.scalar_type()), 0)) {
      return;
    }
#endif
    at::Tensor sum = at::empty(c.sizes(), c.options().dtype(at::kFloat));
    if (accumulate) sum.copy_(c);
    // The bias is added where the sums are rounded, in one pass (c = sum + bias), not copied into
    // the scratch first.
    run_gemm(a, b, sum, std::nullopt, accumulate, convention);
    if (bias) {
      at::Tensor out = c;  // (a handle to c's storage: add_out writes through it)
      at::add_out(out, sum, bias_rows());
    } else {
      c.copy_(sum);
    }
    return;
  }

#ifdef PATCHGEMM_WITH_CUDA
  const bool on_gpu = c.is_cuda();
  const GemmMath math = on_gpu ? gemm_math(convention, a.scalar_type()) : GemmMath{};
  // The Lt bias epilogue makes the bias free, while for plain products the classic API picks the
  // faster kernels for our strided outputs.
  if (on_gpu && bias && plan.calls.size() == 1 &&
      cuda::run_lt_call(plan.calls[0], a, b, c, bias, math, /*algorithm=*/0)) {
    return;  // bias added in the GEMM's epilogue
  }
#else
  const bool on_gpu = false;
#endif
  TORCH_CHECK(on_gpu || c.device().is_cpu(), "patchgemm: no kernel for device ", c.device(),
              " in this build (built without CUDA/ROCm support?)");
  std::vector<BlasCall> calls = plan.calls;
  if (accumulate) {
    for (BlasCall& call : calls) call.accumulate = true;
  }
  // On the CPU one call adds the bias itself (ATen's baddbmm: c is written once).
  if (!on_gpu && bias && calls.size() == 1) {
    cpu::run_blas_calls(calls, a, b, c, bias);
    return;
  }
  // Otherwise the bias goes into c first and every call accumulates onto it (beta = 1).
  if (bias) {
    c.copy_(bias_rows());
    for (BlasCall& call : calls) call.accumulate = true;
  }
#ifdef PATCHGEMM_WITH_CUDA
  if (on_gpu) {
    cuda::run_blas_calls(calls, a, b, c, math);
    return;
  }
#endif
  cpu::run_blas_calls(calls, a, b, c);
}

#ifdef PATCHGEMM_WITH_CUDA
std::string run_gemm_lt(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& c,
                        const std::optional<at::Tensor>& bias, int algorithm, GemmConvention convention) {
  check_gemm_arguments(a_in, b_in, c, bias, false);
  if (!c.is_cuda()) return "CUDA tensors only";
  if (c.numel() == 0 || a_in.size(2) == 0) return "an empty GEMM";
  const PlannedGemm planned = plan_gemm(a_in, b_in, c);
  if (planned.plan.calls.size() != 1 || planned.plan.calls[0].accumulate) {
    return "the GEMM needs more than one BLAS call (split-K guard or sizes past 32 bits)";
  }
  const GemmMath math = gemm_math(convention, planned.a.scalar_type());
  if (!cuda::run_lt_call(planned.plan.calls[0], planned.a, planned.b, c, bias, math, algorithm)) {
    return "cuBLASLt does not apply (fp64, a misaligned bias, or fewer algorithms proposed)";
  }
  return {};
}
#endif

}  // namespace patchgemm
