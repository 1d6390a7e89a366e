// Ragged grouped GEMMs with the group bounds read on the GPU (ragged_gemm.h). One kernel, two
// problems:
//   rows:      the output's rows are split. Each group's rows make ceil(size / 64) row tiles; tiles
//              are numbered group by group, and block x takes tile x, finding its group by a
//              block-wide prefix sum over the groups' tile counts (so the grid, at most
//              ceil(N / 64) + G row tiles, is sized without the sizes). Past the last tile a block
//              returns at once.
//   ragged_k:  the reduction is split: block (x, y, g) sums its tile of out[g] over group g's span.
// Each block: a 64 x 64 output tile, 256 threads of 4 x 4 outputs, the operands staged through
// shared memory 16 reduction steps at a time in the accumulation type. No atomics: each output
// element is written by one thread, its sum taken in one fixed order, so repeated calls are bitwise
// equal.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <type_traits>

#include "kernels/gemm/ragged_gemm.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kTile = 64, kDepth = 16, kThreads = 256, kPerThread = 4;
constexpr int64_t kMaxGridYZ = 65535;

template <typename scalar_t, typename index_t>
struct Args {
  const scalar_t* a;
  int64_t a_rows, a_cols;  // strides of a's two dims
  const scalar_t* b;
  int64_t b_group, b_rows, b_cols;  // b [G, K, Nc] (b_group 0 where ragged_k: b [N, Nc])
  const scalar_t* bias;             // [G, Nc] or null
  int64_t bias_group, bias_cols;
  scalar_t* out;
  int64_t out_group, out_rows, out_cols;  // out_group 0 for rows
  const index_t* offsets;
  int64_t groups;
  int64_t ragged;  // the ragged dim's length: a's rows (rows) or columns (ragged_k)
  int64_t m;       // ragged_k: a's rows
  int64_t k;       // rows: a's columns
  int64_t n;       // Nc
  bool ragged_k;
  bool a_rows_contiguous;  // a's stride along its rows is 1 (loads walk down the rows)
  bool b_rows_contiguous;  // likewise for b's K dim
};

// Group g's span [start, end) in the ragged dim, clamped into [0, ragged] so a malformed offset
// never leads outside the operands; checked by `check` (asserts on the device).
template <typename index_t>
__device__ __forceinline__ void group_span(const index_t* offsets, int64_t groups, int64_t ragged, int64_t g,
                                           bool check, int64_t& start, int64_t& end) {
  const int64_t raw_start = g == 0 ? 0 : static_cast<int64_t>(offsets[g - 1]);
  const int64_t raw_end = static_cast<int64_t>(offsets[g]);
  if (check) {
    CUDA_KERNEL_ASSERT(raw_end >= raw_start && raw_end <= ragged &&
                       "ragged groups: offsets must be non-decreasing, from 0, and within the ragged dim");
    CUDA_KERNEL_ASSERT((g != groups - 1 || raw_end == ragged) && "ragged groups: the sizes must add up to the rows");
  }
  start = raw_start < 0 ? 0 : raw_start > ragged ? ragged : raw_start;
  end = raw_end < start ? start : raw_end > ragged ? ragged : raw_end;
}

// Rows: the group whose tiles hold row tile t, that tile's first row and the group's end; group -1
// past the last tile. The block's threads take 256 groups at a time and prefix-sum their tile
// counts. `check_all`: scan (and check) every group, not only up to t's.
template <typename index_t>
__device__ void locate_tile(const index_t* offsets, int64_t groups, int64_t ragged, int64_t t, bool check_all,
                            int64_t& group, int64_t& row0, int64_t& row_end) {
  __shared__ int64_t counts[kThreads];
  __shared__ int64_t found[3];
  const int tid = threadIdx.x;
  if (tid == 0) found[0] = -1;
  __syncthreads();
  int64_t before = 0;  // the tiles of the groups in earlier chunks
  for (int64_t chunk = 0; chunk < groups; chunk += kThreads) {
    const int64_t g = chunk + tid;
    int64_t start = 0, end = 0, tiles = 0;
    if (g < groups) {
      group_span(offsets, groups, ragged, g, /*check=*/true, start, end);
      tiles = (end - start + kTile - 1) / kTile;
    }
    counts[tid] = tiles;
    __syncthreads();
    for (int step = 1; step < kThreads; step *= 2) {  // inclusive prefix sum
      const int64_t add = tid >= step ? counts[tid - step] : 0;
      __syncthreads();
      counts[tid] += add;
      __syncthreads();
    }
    const int64_t first = before + counts[tid] - tiles;
    if (t >= first && t < first + tiles) {
      found[0] = g;
      found[1] = start + (t - first) * kTile;
      found[2] = end;
    }
    before += counts[kThreads - 1];
    __syncthreads();  // (found is read, and counts rewritten, after every thread's part)
    if (found[0] >= 0 && !check_all) break;
  }
  group = found[0];
  row0 = found[1];
  row_end = found[2];
}

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads) ragged_gemm_kernel(const Args<scalar_t, index_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t a_tile[kDepth][kTile];  // [reduction][row]
  __shared__ acc_t b_tile[kDepth][kTile];  // [reduction][column]
  const int tid = threadIdx.x;
  const bool first_block = blockIdx.x == 0 && blockIdx.y == 0;
  int64_t group, m0, m_end, k0, k_end;
  if (p.ragged_k) {
    group = blockIdx.z;
    m0 = int64_t(blockIdx.x) * kTile;
    m_end = p.m;
    group_span(p.offsets, p.groups, p.ragged, group, /*check=*/first_block, k0, k_end);
  } else {
    locate_tile(p.offsets, p.groups, p.ragged, blockIdx.x, /*check_all=*/first_block, group, m0, m_end);
    if (group < 0) return;
    k0 = 0;
    k_end = p.k;
  }
  const int64_t n0 = int64_t(blockIdx.y) * kTile;
  const scalar_t* b = p.b + group * p.b_group;
  const int row_in = (tid / (kTile / kPerThread)) * kPerThread, col_in = (tid % (kTile / kPerThread)) * kPerThread;
  acc_t acc[kPerThread][kPerThread] = {};

  for (int64_t kb = k0; kb < k_end; kb += kDepth) {
#pragma unroll
    for (int r = 0; r < kTile * kDepth / kThreads; ++r) {
      const int i = tid + r * kThreads;
      // Consecutive threads take consecutive elements of whichever dim is contiguous in memory.
      const int row = p.a_rows_contiguous ? i % kTile : i / kDepth, red = p.a_rows_contiguous ? i / kTile : i % kDepth;
      const int64_t gr = m0 + row, gk = kb + red;
      a_tile[red][row] = gr < m_end && gk < k_end ? static_cast<acc_t>(p.a[gr * p.a_rows + gk * p.a_cols]) : acc_t(0);
      const int col = p.b_rows_contiguous ? i / kDepth : i % kTile;
      const int red_b = p.b_rows_contiguous ? i % kDepth : i / kTile;
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

int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

}  // namespace

bool ragged_gemm_fits(const at::Tensor& a, const at::Tensor& b, bool ragged_k, int64_t groups, std::string& why) {
  const int64_t n = b.size(-1);
  if (tiles_of(n) > kMaxGridYZ) {
    why = "the output's " + std::to_string(n) + " columns make more than 65535 tiles";
    return false;
  }
  if (ragged_k && groups > kMaxGridYZ) {
    why = std::to_string(groups) + " groups: more than 65535";
    return false;
  }
  const int64_t row_tiles = tiles_of(a.size(0)) + (ragged_k ? 0 : groups);
  if (row_tiles > INT32_MAX) {
    why = "more than 2^31 row tiles";
    return false;
  }
  return true;
}

bool ragged_gemm_into(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                      const at::Tensor& offsets, bool ragged_k, const at::Tensor& out, std::string& why) {
  TORCH_INTERNAL_ASSERT(offsets.device() == a.device(), "ragged_gemm_into: the offsets must be on a's device");
  const int64_t groups = offsets.size(0), ragged = ragged_k ? a.size(1) : a.size(0);
  TORCH_CHECK(groups > 0 || ragged == 0, "ragged groups: no groups, but ", ragged, " rows to split");
  if (!ragged_gemm_fits(a, b, ragged_k, groups, why)) return false;
  if (out.numel() == 0) return true;
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t n = b.size(-1);
  const dim3 grid(static_cast<unsigned>(tiles_of(a.size(0)) + (ragged_k ? 0 : groups)),
                  static_cast<unsigned>(tiles_of(n)), static_cast<unsigned>(ragged_k ? groups : 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "ragged_gemm", [&] {
    auto launch = [&](auto* offsets_ptr) {
      using index_t = std::remove_const_t<std::remove_pointer_t<decltype(offsets_ptr)>>;
      Args<scalar_t, index_t> p{};
      p.a = a.const_data_ptr<scalar_t>();
      p.a_rows = a.stride(0);
      p.a_cols = a.stride(1);
      p.b = b.const_data_ptr<scalar_t>();
      p.b_group = ragged_k ? 0 : b.stride(0);
      p.b_rows = b.stride(-2);
      p.b_cols = b.stride(-1);
      p.bias = bias ? bias->const_data_ptr<scalar_t>() : nullptr;
      p.bias_group = bias ? bias->stride(0) : 0;
      p.bias_cols = bias ? bias->stride(1) : 0;
      p.out = out.data_ptr<scalar_t>();
      p.out_group = ragged_k ? out.stride(0) : 0;
      p.out_rows = out.stride(-2);
      p.out_cols = out.stride(-1);
      p.offsets = offsets_ptr;
      p.groups = groups;
      p.ragged = ragged;
      p.m = a.size(0);
      p.k = a.size(1);
      p.n = n;
      p.ragged_k = ragged_k;
      p.a_rows_contiguous = a.stride(0) == 1 && a.stride(1) != 1;
      p.b_rows_contiguous = b.stride(-2) == 1 && b.stride(-1) != 1;
      ragged_gemm_kernel<scalar_t, index_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (offsets.scalar_type() == at::kInt) {
      launch(offsets.const_data_ptr<int32_t>());
    } else {
      launch(offsets.const_data_ptr<int64_t>());
    }
  });
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
