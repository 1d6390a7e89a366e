// What the ragged GEMM kernels (ragged_gemm.cu, sm80/ragged_gemm_mma.cu) share: their arguments,
// and how a block finds its group from the offsets on the GPU. Portable CUDA/HIP.
//   rows:      the output's rows are split. Each group's rows make ceil(size / tile) row tiles;
//              tiles are numbered group by group, and block x takes tile x, finding its group by a
//              block-wide prefix sum over the groups' tile counts (so the grid, at most
//              ceil(N / tile) + G row tiles, is sized without the sizes). Past the last tile a
//              block returns at once.
//   ragged_k:  the reduction is split: block (x, y, g) sums its tile of out[g] over group g's span.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <string>

namespace patchgemm {
namespace cuda {
namespace ragged {

// The operands as raw pointers and element strides (ragged_gemm.h's a, b, bias, out).
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
  const index_t* offsets;                 // contiguous
  int64_t groups;
  int64_t ragged;  // the ragged dim's length: a's rows (rows) or columns (ragged_k)
  int64_t m;       // a's rows
  int64_t k;       // a's columns
  int64_t n;       // Nc
  bool ragged_k;
};

// Calls f(index) with a value of the offsets' index type, int32_t or int64_t (the ops take no other).
template <typename F>
void with_index_type(const at::Tensor& offsets, F&& f) {
  if (offsets.scalar_type() == at::kInt) {
    f(int32_t{});
  } else {
    TORCH_INTERNAL_ASSERT(offsets.scalar_type() == at::kLong, "ragged offsets: int32 or int64, got ",
                          offsets.scalar_type());
    f(int64_t{});
  }
}

template <typename scalar_t, typename index_t>
Args<scalar_t, index_t> make_args(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                                  const at::Tensor& offsets, bool ragged_k, const at::Tensor& out) {
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
  p.offsets = offsets.const_data_ptr<index_t>();
  p.groups = offsets.size(0);
  p.ragged = ragged_k ? a.size(1) : a.size(0);
  p.m = a.size(0);
  p.k = a.size(1);
  p.n = b.size(-1);
  p.ragged_k = ragged_k;
  return p;
}

// Group g's span [start, end) in the ragged dim, clamped into [0, ragged] so a malformed offset
// never leads outside the operands; checked where `check` (device-side asserts).
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

// Rows: the group whose tiles (kTileRows each) hold row tile t, that tile's first row and the
// group's end; group -1 past the last tile. The block's kThreads threads take kThreads groups at a
// time and prefix-sum their tile counts. `check_all`: scan (and check) every group, not only up to
// t's.
template <int kThreads, int kTileRows, typename index_t>
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
      tiles = (end - start + kTileRows - 1) / kTileRows;
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
      found[1] = start + (t - first) * kTileRows;
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

// The block's problem: its group, its rows [m0, m_end) and reduction span [k0, k_end); false past
// the last row tile (rows). Block (0, 0) checks every group's offsets.
template <int kThreads, int kTileRows, typename scalar_t, typename index_t>
__device__ bool block_problem(const Args<scalar_t, index_t>& p, int64_t& group, int64_t& m0, int64_t& m_end,
                              int64_t& k0, int64_t& k_end) {
  const bool first_block = blockIdx.x == 0 && blockIdx.y == 0;
  if (p.ragged_k) {
    group = blockIdx.z;
    m0 = int64_t(blockIdx.x) * kTileRows;
    m_end = p.m;
    group_span(p.offsets, p.groups, p.ragged, group, /*check=*/first_block, k0, k_end);
    return true;
  }
  locate_tile<kThreads, kTileRows>(p.offsets, p.groups, p.ragged, blockIdx.x, /*check_all=*/first_block, group, m0,
                                   m_end);
  k0 = 0;
  k_end = p.k;
  return group >= 0;
}

// The grid for tiles of kTileRows x kTileCols: row tiles (x), column tiles (y), groups (z, ragged_k).
inline dim3 grid_of(int64_t rows, int64_t cols, int64_t groups, bool ragged_k, int64_t tile_rows, int64_t tile_cols) {
  return dim3(static_cast<unsigned>((rows + tile_rows - 1) / tile_rows + (ragged_k ? 0 : groups)),
              static_cast<unsigned>((cols + tile_cols - 1) / tile_cols), static_cast<unsigned>(ragged_k ? groups : 1));
}

// Why a grid of such tiles does not fit (empty where it does): y and z are limited to 65535.
inline std::string grid_limits(int64_t rows, int64_t cols, int64_t groups, bool ragged_k, int64_t tile_rows,
                               int64_t tile_cols) {
  if ((cols + tile_cols - 1) / tile_cols > 65535) {
    return "the output's " + std::to_string(cols) + " columns make more than 65535 tiles";
  }
  if (ragged_k && groups > 65535) return std::to_string(groups) + " groups: more than 65535";
  if ((rows + tile_rows - 1) / tile_rows + (ragged_k ? 0 : groups) > INT32_MAX) return "more than 2^31 row tiles";
  return "";
}

}  // namespace ragged
}  // namespace cuda
}  // namespace patchgemm
