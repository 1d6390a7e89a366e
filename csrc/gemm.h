// The one entry to every GEMM the ops run: a batch of row-major products over strided views.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <optional>

#include "core/strided_gemm.h"

namespace patchgemm {

// c[i] = a[i] @ b[i] (+ bias[i] broadcast over the rows of c[i]), or c[i] += a[i] @ b[i] when
// `accumulate` (no bias then).
// a: [batch, M, K], b: [batch, K, N], c: [batch, M, N], bias: [batch, N] — any strides for a, b
// (an operand no BLAS layout can express is copied once); c must have unit column stride (the ops
// allocate it). Runs on c's device through that device's backend.
void run_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
              const std::optional<at::Tensor>& bias = std::nullopt, bool accumulate = false);

// t summed over dims into t's dtype, accumulated in fp32 (fp64 for fp64): a bias gradient. CUDA's
// reductions accumulate 16-bit sums in fp32 by themselves, in one kernel; CPU half sums do not
// (~5e-3 off), so there the sum runs in the op-math type and is cast after.
inline at::Tensor sum_for_bias_grad(const at::Tensor& t, at::IntArrayRef dims) {
  if (t.is_cuda()) return t.sum(dims);
  return t.sum(dims, false, at::toOpMathType(t.scalar_type())).to(t.scalar_type());
}

// The strided view of a 3-D tensor, as the torch-free planner sees it.
MatrixView matrix_view(const at::Tensor& t3);

namespace cpu {
void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c);
}
#ifdef PATCHGEMM_WITH_CUDA
namespace cuda {
void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c);
// One call with the bias fused into its epilogue; false where that does not apply (the caller
// then adds the bias through beta = 1).
bool run_blas_call_with_bias(const BlasCall& call, const at::Tensor& a, const at::Tensor& b,
                             const at::Tensor& c, const at::Tensor& bias);
}  // namespace cuda
#endif

}  // namespace patchgemm
