// The one entry to every GEMM the ops run: a batch of row-major products over strided views.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "kernels/gemm/strided_gemm.h"

namespace patchgemm {

// Which PyTorch op a GEMM stands in for, so which of torch's flags its numerics follow:
//   kMatmul (nn.Linear, bmm): fp32 in TF32 where torch.backends.cuda.matmul.allow_tf32 (default
//     False); 16-bit split-K partial sums rounded to 16 bits where
//     torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction (default True);
//   kConv (nn.Conv*d): fp32 in TF32 where torch.backends.cudnn.allow_tf32 (default True); 16-bit
//     sums always in fp32, as cuDNN's convolutions sum (a long reduction split in 16 bits is several
//     times less accurate than the conv it replaces).
enum class GemmConvention { kMatmul, kConv };
bool tf32_allowed(GemmConvention convention);
// Whether torch's matmul flag lets a 16-bit GEMM of `dtype` round split-K partial sums to 16 bits
// (false for other dtypes).
bool matmul_reduced_precision_allowed(at::ScalarType dtype);
// What a GEMM of `dtype` under `convention` may do now.
struct GemmMath {
  bool tf32 = false;                 // fp32 may run in TF32
  bool reduced_precision_sums = false;  // 16-bit split-K partials may be rounded to 16 bits
};
GemmMath gemm_math(GemmConvention convention, at::ScalarType dtype);
// Why ATen's matmul (at::linear, matmul, einsum: the matmul convention) may not stand in for a conv
// here, or empty: it may round partial sums to 16 bits where the conv would not -- 16-bit CUDA
// `input`, torch's matmul flag allowing it, and a GEMM ([m, k] @ [k, n], `batch` of them) whose shape
// invites cuBLAS's split-K (the split-K guard's: an output of few tiles, a reduction of 32 K tiles
// or more).
std::string aten_matmul_sums_unlike_a_conv(const at::Tensor& input, int64_t m, int64_t n, int64_t k,
                                           int64_t batch = 1);

// c[i] = a[i] @ b[i] (+ bias[i] broadcast over the rows of c[i]), or c[i] += a[i] @ b[i] when
// `accumulate` (no bias then).
// a: [batch, M, K], b: [batch, K, N], c: [batch, M, N], bias: [batch, N] — any strides for a, b
// (an operand no BLAS layout can express is copied once); c must have unit column stride (the ops
// allocate it), of a and b's dtype, or fp32 for 16-bit a and b (sums the caller rounds once). Runs on c's device
// through that device's backend.
void run_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
              const std::optional<at::Tensor>& bias = std::nullopt, bool accumulate = false,
              GemmConvention convention = GemmConvention::kMatmul);

#ifdef PATCHGEMM_WITH_CUDA
// run_gemm (no accumulate) through cuBLASLt with the `algorithm`-th algorithm its heuristic
// proposes (cuda::run_lt_call), where the GEMM is one BLAS call; else nothing runs and the reason
// is returned (empty: done). Autotune's candidates among cuBLASLt's algorithms.
std::string run_gemm_lt(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        const std::optional<at::Tensor>& bias, int algorithm,
                        GemmConvention convention = GemmConvention::kMatmul);
#endif

// t summed over dims into t's dtype, accumulated in fp32 (fp64 for fp64): a bias gradient. ATen's
// reductions accumulate 16-bit sums in fp32 by themselves and round once, on the GPU and the CPU
// (a sum asked for in fp32 and cast after gives the same bits, 4-7x slower on the CPU). A contiguous
// channels-first t [B, C, *S] summed over all but C (a transpose's bias) sums its contiguous rows,
// then over B: ATen's one reduction over dims {0, 2, ...} runs well below the memory bandwidth,
// contiguous rows at it. Few long rows (a transpose's 32 of 2M elements) leave most SMs idle, so
// they are cut into f pieces each first, for 2048 rows or more. With B = 1 and rows left whole,
// ATen's one reduction is that row sum already: one kernel where the two sums and the cast take
// three. Where every summed dim has size 1 there is nothing to add: t's values are the gradient,
// as ATen's sum_to returns them, with no kernel.
inline at::Tensor sum_for_bias_grad(const at::Tensor& t, at::IntArrayRef dims) {
  if (!dims.empty() && std::all_of(dims.begin(), dims.end(), [&](int64_t d) { return t.size(d) == 1; })) {
    at::Tensor values = t;
    std::vector<int64_t> sorted(dims.begin(), dims.end());
    std::sort(sorted.rbegin(), sorted.rend());
    for (int64_t d : sorted) values = values.squeeze(d);
    return values.contiguous();
  }
  const at::ScalarType acc = at::toOpMathType(t.scalar_type());
  bool all_but_channels = t.dim() >= 3 && t.is_contiguous() && static_cast<int64_t>(dims.size()) == t.dim() - 1;
  for (size_t i = 0; i < dims.size() && all_but_channels; ++i) {
    all_but_channels = dims[i] == (i == 0 ? 0 : static_cast<int64_t>(i) + 1);
  }
  if (all_but_channels) {
    const int64_t rows = t.size(0) * t.size(1), n = rows ? t.numel() / rows : 0;
    int64_t f = 1;
    while (rows * f < 2048 && n % (2 * f) == 0 && n / (2 * f) >= 8192) f *= 2;
    if (t.size(0) > 1 || f > 1) {
      return t.view({t.size(0), t.size(1), f, n / f}).sum(3, false, acc).sum(at::IntArrayRef{0, 2}).to(t.scalar_type());
    }
  }
  return t.sum(dims);
}

// The strided view of a 3-D tensor, as the torch-free planner sees it.
MatrixView matrix_view(const at::Tensor& t3);

// The BLAS this build runs its GPU GEMMs on, as "cuBLAS 13.1.0" / "hipBLAS ...", or "" on CPU builds.
std::string blas_version();

namespace cpu {
// Whether ATen runs this CPU's bfloat16 GEMMs on oneDNN (AVX-512 machines, ATen's CPU capability
// "AVX512"), which reads either BLAS layout at full speed; elsewhere (AVX2) ATen's own bf16 loop runs
// several times faster with its left operand column-major and its right one row-major.
bool bf16_gemms_on_onednn();
// `bias` [batch, N]: only with one call that covers c and does not accumulate; c = bias + product.
void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, const std::optional<at::Tensor>& bias = std::nullopt);
}
// (`math`: what the calls may do, gemm_math of the op's convention.)
#ifdef PATCHGEMM_WITH_CUDA
namespace cuda {
void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, GemmMath math);
// The split-K guard (kernels/gemm/strided_gemm.h) for GEMMs on `input`'s GPU: cuBLAS's K tile of the
// inputs' dtype, and twice the SM count in output tiles. No guard on ROCm.
SplitKGuard split_k_guard(const at::Tensor& input);
// One call through cuBLASLt, the bias (if any) fused into its epilogue, with the `algorithm`-th
// (0 to kLtAlgorithms - 1) of the algorithms cuBLASLt's heuristic proposes for its shape (asked
// once per shape; where 16-bit partial sums must stay in fp32, among those that sum in fp32); false
// where that does not apply: fp64, an fp32 c for 16-bit inputs, accumulate, a bias not 16-byte
// aligned, fewer algorithms proposed, ROCm, or PATCHGEMM_DISABLE_LT=1 (the caller then runs the
// classic API, the bias through beta = 1).
constexpr int kLtAlgorithms = 4;
bool run_lt_call(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                 const std::optional<at::Tensor>& bias, GemmMath math, int algorithm);
// Whether cuBLASLt's fp32 reductions run `call` (a 16-bit GEMM of few output tiles) faster than the
// fp32 scratch does without its filling a wave of small tiles: K at most 8192, on the shapes that
// bound was measured on. Outside them it can pick a slow unsplit kernel even at such K: outputs
// under 32 wide (4 x 512 over K = 8192) or rows off 16-byte vectors (rows of 750 in bf16 over
// K = 6000). False on ROCm.
bool lt_reduction_fits(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c);
// One GEMM of a grouped call: a planned single call (batch 1) and the base pointers of its
// problem's a, b and c (the planner's offsets are from these).
struct GroupedBlasCall {
  BlasCall call;
  const void* a;
  const void* b;
  void* c;
};
// c[i] = scale_a * scale_b * a[i] @ b[i]^T (+ bias[i] broadcast over the rows of c[i]) for FP8 a
// [batch, M, K] and b [batch, N, K] (e4m3fn or e5m2, not both e5m2) whose K is contiguous (Hopper's
// FP8 GEMMs read both operands K-major); c [batch, M, N] bfloat16, float16 or float32 with unit
// column stride; scales float32 scalars on c's GPU (dequantization factors); bias [batch, N] of c's
// dtype. One cuBLASLt strided-batched matmul, sums in fp32 (`fast_accum`: Hopper's faster FP8
// accumulation, which rounds partial sums more often). Returns why it does not apply (empty: done):
// a GPU before sm_89, ROCm, or sizes, strides or pointers off cuBLASLt's 16-byte FP8 alignment.
std::string run_scaled_gemm_lt(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, const at::Tensor& c, const std::optional<at::Tensor>& bias,
                               bool fast_accum);
// Whether this build has cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx, cuBLAS 12.5+; not
// hipBLAS), for float32, float16 and bfloat16.
bool has_grouped_gemm();
// All of `calls` (of one dtype, on `device`) as one grouped GEMM: the pointer arrays are copied to
// the GPU asynchronously, the sizes stay on the host.
void run_grouped_blas_calls(const std::vector<GroupedBlasCall>& calls, at::ScalarType dtype,
                            at::Device device, GemmMath math);
}  // namespace cuda
#endif

}  // namespace patchgemm
