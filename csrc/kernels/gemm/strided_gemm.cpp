#include "kernels/gemm/strided_gemm.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <optional>
#include <utility>

namespace patchgemm {
namespace {

struct BlasOperand {
  bool trans;
  int64_t ld;
};

// BLAS is column-major: a row-major matrix X[r, c] read as stored column-major data is X^T.
// Returns (op, ld) such that op(stored X) == X^T, or nothing if no leading dimension describes X.
// Strides of size-1 dimensions are irrelevant and ignored. One contiguous column (an input of a
// GEMM with K = 1 or N = 1) is described, as ATen describes it, transposed with ld = its length when
// `column_as_column`: read as one row of ld 1 instead, cuBLAS's heuristic picks a pre-Hopper kernel
// up to 3x slower (the batch-one grouped weight gradient, K = 1). Outputs are written untransposed,
// so they always take the row form.
std::optional<BlasOperand> transposed_as_blas(const MatrixView& x, bool column_as_column) {
  if (column_as_column && x.cols <= 1 && x.rows > 1 && x.row_stride == 1) return BlasOperand{true, x.rows};
  if (x.col_stride == 1 || x.cols <= 1) {
    const int64_t ld = x.rows <= 1 ? std::max<int64_t>(1, x.cols) : x.row_stride;
    if (ld >= std::max<int64_t>(1, x.cols)) return BlasOperand{false, ld};
  }
  if (x.row_stride == 1 || x.rows <= 1) {
    const int64_t ld = x.cols <= 1 ? std::max<int64_t>(1, x.rows) : x.col_stride;
    if (ld >= std::max<int64_t>(1, x.rows)) return BlasOperand{true, ld};
  }
  return std::nullopt;
}

// An input operand's form: a column longer than the BLAS integer limit keeps the row form (ld 1),
// which the planner splits along its length.
std::optional<BlasOperand> input_as_blas(const MatrixView& x, int64_t int_limit) {
  const auto op = transposed_as_blas(x, /*column_as_column=*/true);
  return op && op->ld > int_limit ? transposed_as_blas(x, false) : op;
}

// C is written, not read through an op: it must be the non-transposed case.
bool output_ok(const MatrixView& c) {
  auto op = transposed_as_blas(c, /*column_as_column=*/false);
  return op.has_value() && !op->trans;
}

std::atomic<int64_t> g_int_limit{INT_MAX};

// Whether the guard splits a call of this shape (m x n output per batch, reduction length k).
bool splits_k_tail(const SplitKGuard& guard, int64_t m, int64_t n, int64_t k, int64_t batch) {
  return guard.invites_split_k(m, n, k, batch) && k > guard.k_tile && k % guard.k_tile != 0;
}

}  // namespace

LayoutVerdict check_blas_layout(const GemmProblem& p) {
  return {transposed_as_blas(p.a, false).has_value(), transposed_as_blas(p.b, false).has_value(), output_ok(p.c)};
}

BlasPlan plan_blas_calls(const GemmProblem& p, int64_t int_limit, const SplitKGuard& guard) {
  const auto op_a = input_as_blas(p.a, int_limit);  // becomes BLAS B
  const auto op_b = input_as_blas(p.b, int_limit);  // becomes BLAS A
  if (!op_a || !op_b || !output_ok(p.c)) {
    return {{}, "an operand's strides have no BLAS layout"};
  }
  const int64_t ldc = p.c.rows <= 1 ? std::max<int64_t>(1, p.c.cols) : p.c.row_stride;
  const int64_t max_ld = std::max({op_a->ld, op_b->ld, ldc});
  if (max_ld > int_limit) {
    return {{}, "a leading dimension (" + std::to_string(max_ld) +
                    ") exceeds the BLAS integer limit (" + std::to_string(int_limit) +
                    "); make the tensor contiguous or smaller"};
  }
  const int64_t M = p.a.rows, K = p.a.cols, N = p.b.cols;
  BlasPlan plan;
  std::vector<BlasCall>& calls = plan.calls;
  // C = A @ B (row-major) is C^T = B^T @ A^T (column-major): BLAS A is the problem's B.
  for (int64_t b0 = 0; b0 < std::max<int64_t>(p.batch, 1); b0 += int_limit) {
    const int64_t nb = std::min(int_limit, p.batch - b0);
    for (int64_t m0 = 0; m0 < std::max<int64_t>(M, 1); m0 += int_limit) {
      const int64_t mc = std::min(int_limit, M - m0);
      for (int64_t n0 = 0; n0 < std::max<int64_t>(N, 1); n0 += int_limit) {
        const int64_t nc = std::min(int_limit, N - n0);
        for (int64_t k0 = 0; k0 < std::max<int64_t>(K, 1); k0 += int_limit) {
          const int64_t kc = std::min(int_limit, K - k0);
          const int64_t tail = splits_k_tail(guard, mc, nc, kc, nb) ? kc % guard.k_tile : 0;
          // [k0, k0 + kc) as one call, or as its whole K tiles and then their remainder.
          const std::pair<int64_t, int64_t> ranges[] = {{k0, kc - tail}, {k0 + kc - tail, tail}};
          for (int r = 0; r < (tail > 0 ? 2 : 1); ++r) {
            const auto [k_begin, k_size] = ranges[r];
            BlasCall c;
            c.trans_a = op_b->trans;
            c.trans_b = op_a->trans;
            c.m = nc;
            c.n = mc;
            c.k = k_size;
            c.lda = op_b->ld;
            c.ldb = op_a->ld;
            c.ldc = ldc;
            c.stride_a = p.b.batch_stride;
            c.stride_b = p.a.batch_stride;
            c.stride_c = p.c.batch_stride;
            c.batch = nb;
            c.offset_a = b0 * p.b.batch_stride + k_begin * p.b.row_stride + n0 * p.b.col_stride;
            c.offset_b = b0 * p.a.batch_stride + m0 * p.a.row_stride + k_begin * p.a.col_stride;
            c.offset_c = b0 * p.c.batch_stride + m0 * p.c.row_stride + n0 * p.c.col_stride;
            c.accumulate = k_begin > 0;
            calls.push_back(c);
          }
        }
      }
    }
  }
  return plan;
}

int64_t blas_int_limit() { return g_int_limit.load(); }

int64_t set_blas_int_limit(int64_t limit) { return g_int_limit.exchange(limit); }

}  // namespace patchgemm
