// CPU backend: runs the same planned column-major calls as the GPU, through ATen's bmm on strided
// views, so the planner (layouts, splitting) is exercised on every machine.
#include "kernels/gemm/gemm.h"

namespace patchgemm {

#ifndef PATCHGEMM_WITH_CUDA
std::string blas_version() { return ""; }
#endif

namespace cpu {
namespace {

// op(M) of a column-major BLAS operand, as a [batch, rows, cols] view.
at::Tensor op_view(const at::Tensor& base, int64_t offset, int64_t batch, int64_t rows,
                   int64_t cols, int64_t ld, int64_t batch_stride, bool trans) {
  const int64_t row_stride = trans ? ld : 1;
  const int64_t col_stride = trans ? 1 : ld;
  return base.as_strided({batch, rows, cols}, {batch_stride, row_stride, col_stride},
                         base.storage_offset() + offset);
}

}  // namespace

void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c) {
  for (const BlasCall& call : calls) {
    // Column-major C = op(A) @ op(B), with BLAS A the problem's b and BLAS B the problem's a.
    const at::Tensor op_a =
        op_view(b, call.offset_a, call.batch, call.m, call.k, call.lda, call.stride_a, call.trans_a);
    const at::Tensor op_b =
        op_view(a, call.offset_b, call.batch, call.k, call.n, call.ldb, call.stride_b, call.trans_b);
    at::Tensor out =
        op_view(c, call.offset_c, call.batch, call.m, call.n, call.ldc, call.stride_c, false);
    // (c in fp32 for 16-bit a and b: the product is formed in fp32 too.)
    const at::Tensor product = c.scalar_type() == a.scalar_type()
                                   ? at::bmm(op_a, op_b)
                                   : at::bmm(op_a.to(c.scalar_type()), op_b.to(c.scalar_type()));
    call.accumulate ? out.add_(product) : out.copy_(product);
  }
}

}  // namespace cpu
}  // namespace patchgemm
