// A bias gradient where no GEMM yields it: the column sums of tokens grad_y [M, E], 16-bit, in fp32,
// rounded once. ATen's reduction over rows runs such a sum as two or three kernels (and a few
// hundred columns poorly); this is one pass over grad_y. A block takes 256 columns (8 per lane, one
// 16-byte load) of a range of rows, its 8 warps every 8th row, and adds the warps' sums in a fixed
// order; with several ranges, sum_token_ranges.cu adds the ranges' fp32 sums in a fixed order too.
// No atomics: repeated calls are bitwise equal.
#include <ATen/ATen.h>

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/patch/patchify.h"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kWarps = 8, kColumnsPerLane = 8, kColumnsPerBlock = 32 * kColumnsPerLane;
constexpr int kRowsInFlight = 4;  // independent 16-byte loads per lane before the adds

// Block (x, y): columns [x * 256, + 256) over rows [y * rows_per_range, + rows_per_range). Writes
// its sums into sums [gridDim.y, E] (fp32), or, with one range, into out [E] (T) directly.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    column_sums_kernel(const T* __restrict__ rows, int64_t M, int64_t ld, int E, int64_t rows_per_range,
                       float* __restrict__ sums, T* __restrict__ out) {
  __shared__ float warp_sums[kWarps][kColumnsPerBlock];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int column = blockIdx.x * kColumnsPerBlock + lane * kColumnsPerLane;
  const int64_t begin = blockIdx.y * rows_per_range, end = M < begin + rows_per_range ? M : begin + rows_per_range;
  float sum[kColumnsPerLane] = {};
  if (column < E) {  // (E % 8 == 0: a lane's 8 columns are all in or all out)
    const T* p = rows + column;
    auto add = [&](const uint4& v) {
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float lo, hi;
        unpack2<T>(words[w], lo, hi);
        sum[2 * w] += lo, sum[2 * w + 1] += hi;
      }
    };
    int64_t r = begin + warp;
    for (; r + (kRowsInFlight - 1) * kWarps < end; r += kRowsInFlight * kWarps) {
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) v[i] = *reinterpret_cast<const uint4*>(p + (r + i * kWarps) * ld);
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) add(v[i]);
    }
    for (; r < end; r += kWarps) add(*reinterpret_cast<const uint4*>(p + r * ld));
  }
#pragma unroll
  for (int i = 0; i < kColumnsPerLane; ++i) warp_sums[warp][lane * kColumnsPerLane + i] = sum[i];
  __syncthreads();
  const int c = blockIdx.x * kColumnsPerBlock + threadIdx.x;  // a thread per column of the block
  if (c >= E) return;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w][threadIdx.x];
  if (gridDim.y == 1) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[c] = __float2bfloat16_rn(total);
    } else {
      out[c] = __float2half_rn(total);
    }
  } else {
    sums[blockIdx.y * int64_t{E} + c] = total;
  }
}

}  // namespace

bool column_sums(const at::Tensor& rows, const at::Tensor& out) {
  const at::ScalarType type = rows.scalar_type();
  if (!rows.is_cuda() || rows.dim() != 2 || (type != at::kHalf && type != at::kBFloat16)) return false;
  const int64_t M = rows.size(0), E = rows.size(1), ld = rows.stride(0);
  if (M == 0 || E == 0 || E % kColumnsPerLane || E > INT32_MAX || rows.stride(1) != 1 || ld % kColumnsPerLane ||
      reinterpret_cast<uintptr_t>(rows.const_data_ptr()) % 16) {
    return false;
  }
  TORCH_CHECK(out.is_contiguous() && out.numel() == E && out.scalar_type() == type, "column_sums: out must be [E]");
  // About two blocks per SM, in ranges of more than 256 rows (32 per warp): up to 256 rows, one
  // kernel writes the sums itself.
  const int64_t column_blocks = (E + kColumnsPerBlock - 1) / kColumnsPerBlock;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t ranges = std::clamp<int64_t>((2 * sms + column_blocks - 1) / column_blocks, 1, (M + 255) / 256);
  const int64_t rows_per_range = (M + ranges - 1) / ranges;
  ranges = (M + rows_per_range - 1) / rows_per_range;
  const at::Tensor sums = ranges > 1 ? at::empty({ranges, E}, rows.options().dtype(at::kFloat)) : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(ranges));
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    column_sums_kernel<T><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(rows.const_data_ptr()), M, ld, static_cast<int>(E), rows_per_range,
        ranges > 1 ? sums.data_ptr<float>() : nullptr, static_cast<T*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  type == at::kHalf ? run(static_cast<__half*>(nullptr)) : run(static_cast<__nv_bfloat16*>(nullptr));
  if (ranges > 1) sum_token_ranges(at::Tensor(), sums, at::Tensor(), out);
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
