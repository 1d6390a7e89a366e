// Torch-free description of "one GEMM over strided views" and the planner that turns it into
// column-major BLAS calls (cuBLAS / hipBLAS gemmStridedBatchedEx).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace patchgemm {

// A batch of row-major matrices: element (b, i, j) lives at
// b * batch_stride + i * row_stride + j * col_stride (in elements).
struct MatrixView {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
  int64_t batch_stride = 0;

  MatrixView transposed() const { return {cols, rows, col_stride, row_stride, batch_stride}; }
};

// C[b] = alpha * A[b] @ B[b] + beta * C[b] for b < batch; A is M x K, B is K x N, C is M x N.
struct GemmProblem {
  int64_t batch = 1;
  MatrixView a, b, c;
};

// One column-major strided-batched call, in the argument order of cublasGemmStridedBatchedEx.
// Offsets are in elements from the base pointers of the problem's A, B and C; `accumulate`
// means this call must add to C (beta = 1) because an earlier call wrote part of the sum.
struct BlasCall {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 1, ldb = 1, ldc = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  int64_t batch = 1;
  int64_t offset_a = 0, offset_b = 0, offset_c = 0;  // into the BLAS call's A (= problem's B) etc.
  bool accumulate = false;
};

// Which operands of a problem no BLAS layout can express (they need one contiguous copy).
struct LayoutVerdict {
  bool a_ok = true, b_ok = true, c_ok = true;
  bool ok() const { return a_ok && b_ok && c_ok; }
};

LayoutVerdict check_blas_layout(const GemmProblem& p);

struct BlasPlan {
  std::vector<BlasCall> calls;
  std::string error;  // non-empty: no plan (the calls are empty)
};

// cuBLAS's split-K kernels (12.x and 13.x on Hopper; seen with 13.1, bf16 and fp16, on the H100 and
// H200, and through torch.mm too) can silently return the product summed over only the first
// K - K % k_tile values of k, where k_tile is the kernel's K tile (128 bytes of k). A call whose
// shape invites split-K -- a long K (the shortest seen losing its tail: 7,106 on the H200; a sweep
// of K up to 8,300 on the H100 lost none below 38,000) that is not a whole number of tiles, and an
// output of few tiles -- is therefore planned as two: K's whole tiles, then the remainder (below
// one tile, so unsplittable) accumulated onto them. Neither can lose a tail; the second rereads
// the small output once, which shorter reductions are spared.
// The 128 x 128 tiles of `batch` outputs of rows x cols (cuBLAS's and the fused kernels' CTA tile).
inline int64_t output_tiles(int64_t rows, int64_t cols, int64_t batch = 1) {
  return (rows + 127) / 128 * ((cols + 127) / 128) * batch;
}

struct SplitKGuard {
  int64_t k_tile = 0;     // in elements; 0: no guard (CPU, ROCm)
  int64_t max_tiles = 0;  // outputs of fewer 128 x 128 tiles (all batches together) are guarded
  int64_t min_k = 0;      // reductions shorter than this are not guarded

  // Whether a GEMM of this shape (m x n outputs, `batch` of them, reduction length k) invites
  // cuBLAS's split-K: a long reduction into few output tiles.
  bool invites_split_k(int64_t m, int64_t n, int64_t k, int64_t batch) const {
    return k_tile > 0 && k >= min_k && output_tiles(m, n, batch) < max_tiles;
  }
  // Whether such outputs fill under half a wave (max_tiles is two waves): an unsplit reduction
  // leaves most SMs idle.
  bool under_half_a_wave(int64_t m, int64_t n, int64_t batch) const {
    return 4 * output_tiles(m, n, batch) < max_tiles;
  }
  // Whether such outputs fill a wave of the 64 x 32 tiles of cuBLASLt's smallest unsplit kernels
  // (two of 32 x 32), which keeps every SM busy without splitting K. Two thirds of a wave leave a
  // long reduction unsplit at half the speed of a split one (dW of 384 x 392 over 31,680 tokens).
  bool fills_small_tiles(int64_t m, int64_t n, int64_t batch) const {
    return ((m + 31) / 32) * ((n + 31) / 32) * batch >= max_tiles;
  }
};

// Plans `p` as column-major BLAS calls whose every size, leading dimension and batch count fits
// in `int_limit` (cuBLAS's classic API takes 32-bit ints). Usually one call; more when M, N, K or
// the batch must be split, or `guard` splits off K's remainder. Fails if a layout is not
// expressible (call check_blas_layout first) or a single leading dimension exceeds the limit.
BlasPlan plan_blas_calls(const GemmProblem& p, int64_t int_limit, const SplitKGuard& guard = {});

// The limit the backends plan with; tests lower it to exercise splitting on small tensors.
int64_t blas_int_limit();
int64_t set_blas_int_limit(int64_t limit);  // limit in [1, INT_MAX]; returns the previous value

}  // namespace patchgemm
