// The portable ragged GEMM (ragged_gemm.h), groups found on the GPU (ragged_groups.cuh). Each
// block: a 64 x 64 output tile, 256 threads of 4 x 4 outputs, the operands staged through shared
// memory 16 reduction steps at a time in the accumulation type. No atomics: each output element is
// written by one thread, its sum taken in one fixed order, so repeated calls are bitwise equal.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/gemm/ragged_gemm.h"
#include "kernels/gemm/ragged_groups.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kTile = 64, kDepth = 16, kThreads = 256, kPerThread = 4;

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads) ragged_gemm_kernel(const ragged::Args<scalar_t, index_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t a_tile[kDepth][kTile];  // [reduction][row]
  __shared__ acc_t b_tile[kDepth][kTile];  // [reduction][column]
  int64_t group, m0, m_end, k0, k_end;
  if (!ragged::block_problem<kThreads, kTile>(p, group, m0, m_end, k0, k_end)) return;
  const int tid = threadIdx.x;
  const int64_t n0 = int64_t(blockIdx.y) * kTile;
  const scalar_t* b = p.b + group * p.b_group;
  const int row_in = (tid / (kTile / kPerThread)) * kPerThread, col_in = (tid % (kTile / kPerThread)) * kPerThread;
  // Consecutive threads load consecutive elements of whichever dim is contiguous in memory.
  const bool a_down_rows = p.a_rows == 1 && p.a_cols != 1, b_down_rows = p.b_rows == 1 && p.b_cols != 1;
  acc_t acc[kPerThread][kPerThread] = {};

  for (int64_t kb = k0; kb < k_end; kb += kDepth) {
#pragma unroll
    for (int r = 0; r < kTile * kDepth / kThreads; ++r) {
      const int i = tid + r * kThreads;
      const int row = a_down_rows ? i % kTile : i / kDepth, red = a_down_rows ? i / kTile : i % kDepth;
      const int64_t gr = m0 + row, gk = kb + red;
      a_tile[red][row] = gr < m_end && gk < k_end ? static_cast<acc_t>(p.a[gr * p.a_rows + gk * p.a_cols]) : acc_t(0);
      const int col = b_down_rows ? i / kDepth : i % kTile, red_b = b_down_rows ? i % kDepth : i / kTile;
      const int64_t gc = n0 + col, gkb = kb + red_b;
      b_tile[red_b][col] =
          gc < p.n && gkb < k_end ? static_cast<acc_t>(b[gkb * p.b_rows + gc * p.b_cols]) : acc_t(0);
    }
    __syncthreads();
#pragma unroll
    for (int red = 0; red < kDepth; ++red) {
      acc_t av[kPerThread], bv[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        av[i] = a_tile[red][row_in + i];
        bv[i] = b_tile[red][col_in + i];
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) acc[i][j] += av[i] * bv[j];
      }
    }
    __syncthreads();
  }

  scalar_t* out = p.out + group * p.out_group;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t gr = m0 + row_in + i;
    if (gr >= m_end) continue;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t gc = n0 + col_in + j;
      if (gc >= p.n) continue;
      acc_t v = acc[i][j];
      if (p.bias) v += static_cast<acc_t>(p.bias[group * p.bias_group + gc * p.bias_cols]);
      out[gr * p.out_rows + gc * p.out_cols] = static_cast<scalar_t>(v);
    }
  }
}

}  // namespace

std::string ragged_gemm_declines(const at::Tensor& a, const at::Tensor& b, bool ragged_k, int64_t groups) {
  return ragged::grid_limits(a.size(0), b.size(-1), groups, ragged_k, kTile, kTile);
}

void ragged_gemm_into(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                      const at::Tensor& offsets, bool ragged_k, const at::Tensor& out) {
  const std::string why = ragged_gemm_declines(a, b, ragged_k, offsets.size(0));
  TORCH_INTERNAL_ASSERT(why.empty(), "ragged_gemm_into: ", why);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const dim3 grid = ragged::grid_of(a.size(0), b.size(-1), offsets.size(0), ragged_k, kTile, kTile);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "ragged_gemm", [&] {
    ragged::with_index_type(offsets, [&](auto index) {
      ragged_gemm_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          ragged::make_args<scalar_t, decltype(index)>(a, b, bias, offsets, ragged_k, out));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace patchgemm
