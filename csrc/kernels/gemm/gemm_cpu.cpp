// CPU backend: runs the same planned column-major calls as the GPU, through ATen's mm / bmm on
// strided views, so the planner (layouts, splitting) is exercised on every machine.
#include "kernels/gemm/gemm.h"

#include <ATen/Version.h>

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

// ATen's own CPU bfloat16 GEMM (without oneDNN: bf16_gemms_on_onednn) runs several times faster
// with its left operand column-major and its right one row-major than in any other layout (2-10x on
// AVX2, mm and bmm alike, at the shapes of the bench suite); a copy into that layout costs one pass
// over the operand, a few percent of the product it speeds up. On oneDNN the copies are pure cost
// (a grouped linear's forward: 5x).
at::Tensor column_major(const at::Tensor& t) {
  return t.stride(1) == 1 || t.size(1) == 1 ? t : t.transpose(1, 2).contiguous().transpose(1, 2);
}
at::Tensor row_major(const at::Tensor& t) { return t.stride(2) == 1 || t.size(2) == 1 ? t : t.contiguous(); }

// Batches interleaved in memory (x [B, G, D] read as [G, B, D]: a batch stride below the matrix's
// extent) made batch-major, each matrix keeping its orientation. oneDNN's bfloat16 bmm copies
// such an operand itself into row-major order, which for a transposed one (an output gradient read
// as [G, N, B]) is a transposition 2-3x slower than the GEMM it feeds; this copy moves whole rows.
at::Tensor batch_major(const at::Tensor& t) {
  const int64_t extent = (t.size(1) - 1) * t.stride(1) + (t.size(2) - 1) * t.stride(2) + 1;
  if (t.size(0) == 1 || t.stride(0) >= extent) return t;
  return t.stride(1) == 1 && t.stride(2) != 1 ? t.transpose(1, 2).contiguous().transpose(1, 2) : t.contiguous();
}

}  // namespace

bool bf16_gemms_on_onednn() {
  static const bool onednn = at::get_cpu_capability() == "AVX512";
  return onednn;
}

namespace {

// One call's operands as ATen sees them: c[batch, M, N] = lhs @ rhs, in c's dtype.
struct CallOperands {
  at::Tensor lhs, rhs, out;
};

CallOperands call_operands(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  // Column-major C = op(A) @ op(B), with BLAS A the problem's b and BLAS B the problem's a, run
  // row-major as C^T = op(B)^T @ op(A)^T: ATen then reads the problem's own a and b views and
  // writes into c's rows, which are contiguous in this orientation. (In the column-major one c
  // is transposed, and ATen's strided 16-bit loops for that are many times slower.)
  const at::Tensor lhs =
      op_view(a, call.offset_b, call.batch, call.k, call.n, call.ldb, call.stride_b, call.trans_b).transpose(1, 2);
  const at::Tensor rhs =
      op_view(b, call.offset_a, call.batch, call.m, call.k, call.lda, call.stride_a, call.trans_a).transpose(1, 2);
  at::Tensor out =
      op_view(c, call.offset_c, call.batch, call.m, call.n, call.ldc, call.stride_c, false).transpose(1, 2);
  // (c in fp32 for 16-bit a and b: the product is formed in fp32 too.)
  const bool widen = c.scalar_type() != a.scalar_type();
  at::Tensor l = widen ? lhs.to(c.scalar_type()) : lhs, r = widen ? rhs.to(c.scalar_type()) : rhs;
  if (l.scalar_type() == at::kBFloat16 && !bf16_gemms_on_onednn()) {
    l = column_major(l);
    r = row_major(r);
  } else if (l.scalar_type() == at::kBFloat16 && call.batch > 1) {
    l = batch_major(l);
    r = batch_major(r);
  }
  return {l, r, out};
}

// Batches apart in memory (a group's rows of a [B, G, N] output): ATen's fp32 bmm_out into the
// strided view runs slower than its bmm into a fresh tensor plus one copy (fp32 forward and input
// gradients: 1.05-2x); its bfloat16 GEMMs write the view as fast as a fresh tensor.
bool writes_in_place(const at::Tensor& out) {
  return out.is_contiguous() || out.scalar_type() == at::kBFloat16;
}

}  // namespace

void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, const std::optional<at::Tensor>& bias) {
  // A bias is ATen's `self` of the one call that covers c: c = bias + the product, written once.
  TORCH_INTERNAL_ASSERT(!bias || (calls.size() == 1 && !calls[0].accumulate && calls[0].offset_c == 0 &&
                                  calls[0].batch == c.size(0)));
  const at::Tensor bias_row = bias ? bias->to(c.scalar_type()).unsqueeze(1) : at::Tensor();  // [batch, 1, N]
  for (const BlasCall& call : calls) {
    auto [l, r, out] = call_operands(call, a, b, c);
    // A single product goes through mm, whose CPU GEMM is faster than bmm's at batch 1.
    if (call.batch == 1) {
      at::Tensor out2 = out.select(0, 0);
      if (bias) {
        at::addmm_out(out2, bias_row[0], l[0], r[0]);
      } else {
        call.accumulate ? out2.addmm_(l[0], r[0]) : at::mm_out(out2, l[0], r[0]);
      }
    } else if (call.accumulate) {
      out.baddbmm_(l, r);
    } else if (writes_in_place(out)) {
      bias ? at::baddbmm_out(out, bias_row, l, r) : at::bmm_out(out, l, r);
    } else {
      out.copy_(bias ? at::baddbmm(bias_row, l, r) : at::bmm(l, r));
    }
  }
}

}  // namespace cpu
}  // namespace patchgemm
