// The ragged GEMM on tensor cores (ragged_gemm.h): float16 / bfloat16, sm_80+, groups found on the
// GPU (ragged_groups.cuh). Each block: a 128 x 128 output tile, 8 warps of 64 x 32 in WMMA's
// 16 x 16 x 16 fragments with fp32 accumulators. The operands are staged through shared memory 32
// reduction steps at a time, A as [row][reduction] and B as [reduction][column] whatever their
// layout, in 16-byte pieces along the dim that is contiguous where the strides and sizes allow
// (element by element otherwise). Each output element is one fragment's, summed in one fixed order:
// repeated calls are bitwise equal.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>

#include "kernels/gemm/ragged_gemm.h"
#include "kernels/gemm/ragged_groups.cuh"

namespace patchgemm {
namespace cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kThreads = 256;
constexpr int kPad = 8;                 // elements past each shared row: rows 16 bytes apart in banks
constexpr int kWarpM = 64, kWarpN = 32; // the 8 warps: 2 down, 4 across
constexpr int kPiece = 8;               // elements in a 16-byte piece

template <typename T>
struct WmmaType;
template <>
struct WmmaType<at::Half> {
  using type = __half;
};
template <>
struct WmmaType<at::BFloat16> {
  using type = __nv_bfloat16;
};

// Which loads move 16-byte pieces: along a's reduction dim (rows) or its rows (ragged_k), along
// b's columns or its reduction dim (rows). Each needs that dim contiguous, the other strides and
// the dim's length multiples of 8, and the pointer 16-byte aligned.
struct Pieces {
  bool a_along_k, a_along_m, b_along_n, b_along_k;
};

// Stages the kRows x kCols tile at (r0, c0) of src (element (r, c) at src[r * r_stride + c * c_stride],
// present where r < r_end and c < c_end, zeros elsewhere) into dst: in 16-byte pieces along c where
// along_c, along r where along_r (each needs that dim contiguous: Pieces), else element by element.
template <int kRows, int kRowLength>
__device__ __forceinline__ void stage(uint16_t (&dst)[kRows][kRowLength], const uint16_t* src, int64_t r0,
                                      int64_t r_end, int64_t r_stride, int64_t c0, int64_t c_end, int64_t c_stride,
                                      bool along_c, bool along_r) {
  constexpr int kCols = kRowLength - kPad;
  const int tid = threadIdx.x;
  if (along_c || along_r) {
    constexpr int kAcross = kCols / kPiece, kDown = kRows / kPiece;  // pieces per row / per column
#pragma unroll
    for (int i = 0; i < kRows * kCols / kPiece / kThreads; ++i) {
      const int piece = tid + i * kThreads;
      const int r = along_c ? piece / kAcross : piece % kDown * kPiece;
      const int c = along_c ? piece % kAcross * kPiece : piece / kDown;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r0 + r < r_end && c0 + c < c_end) {
        v = *reinterpret_cast<const uint4*>(src + (r0 + r) * r_stride + (c0 + c) * c_stride);
      }
      if (along_c) {
        *reinterpret_cast<uint4*>(&dst[r][c]) = v;
      } else {
        const auto* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
        for (int j = 0; j < kPiece; ++j) dst[r + j][c] = e[j];
      }
    }
    return;
  }
  const bool down = r_stride == 1;  // consecutive threads take consecutive elements in memory
#pragma unroll 4
  for (int i = 0; i < kRows * kCols / kThreads; ++i) {
    const int element = tid + i * kThreads;
    const int r = down ? element % kRows : element / kCols, c = down ? element / kRows : element % kCols;
    dst[r][c] = r0 + r < r_end && c0 + c < c_end ? src[(r0 + r) * r_stride + (c0 + c) * c_stride] : uint16_t(0);
  }
}

// (Two blocks per SM: the registers capped at 128, a few spilled, and about 1.3x faster than one
// block of 224 registers.)
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads, 2)
    ragged_gemm_mma_kernel(const ragged::Args<scalar_t, index_t> p, const Pieces pieces) {
#if __CUDA_ARCH__ >= 800
  using T = typename WmmaType<scalar_t>::type;
  __shared__ __align__(32) uint16_t a_tile[kTileM][kTileK + kPad];  // [row][reduction]
  __shared__ __align__(32) uint16_t b_tile[kTileK][kTileN + kPad];  // [reduction][column]
  __shared__ __align__(32) float scratch[kThreads / 32][16 * 16];   // one fragment per warp, for the epilogue
  int64_t group, m0, m_end, k0, k_end;
  if (!ragged::block_problem<kThreads, kTileM>(p, group, m0, m_end, k0, k_end)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int warp_row = (warp / (kTileN / kWarpN)) * kWarpM, warp_col = (warp % (kTileN / kWarpN)) * kWarpN;
  const int64_t n0 = int64_t(blockIdx.y) * kTileN;
  const auto* a = reinterpret_cast<const uint16_t*>(p.a);
  const auto* b = reinterpret_cast<const uint16_t*>(p.b + group * p.b_group);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kWarpM / 16][kWarpN / 16];
#pragma unroll
  for (int i = 0; i < kWarpM / 16; ++i) {
#pragma unroll
    for (int j = 0; j < kWarpN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  }

  for (int64_t kb = k0; kb < k_end; kb += kTileK) {
    stage(a_tile, a, m0, m_end, p.a_rows, kb, k_end, p.a_cols, pieces.a_along_k, pieces.a_along_m);
    stage(b_tile, b, kb, k_end, p.b_rows, n0, p.n, p.b_cols, pieces.b_along_n, pieces.b_along_k);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf[kWarpN / 16];
#pragma unroll
      for (int j = 0; j < kWarpN / 16; ++j) {
        wmma::load_matrix_sync(bf[j], reinterpret_cast<const T*>(&b_tile[kk][warp_col + j * 16]), kTileN + kPad);
      }
#pragma unroll
      for (int i = 0; i < kWarpM / 16; ++i) {  // (one A fragment at a time: fewer live registers)
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af;
        wmma::load_matrix_sync(af, reinterpret_cast<const T*>(&a_tile[warp_row + i * 16][kk]), kTileK + kPad);
#pragma unroll
        for (int j = 0; j < kWarpN / 16; ++j) wmma::mma_sync(acc[i][j], af, bf[j], acc[i][j]);
      }
    }
    __syncthreads();
  }

  // Each fragment through the warp's scratch: bias, rounding, bounds, any output strides.
  scalar_t* out = p.out + group * p.out_group;
  float* mine = scratch[warp];
#pragma unroll
  for (int i = 0; i < kWarpM / 16; ++i) {
#pragma unroll
    for (int j = 0; j < kWarpN / 16; ++j) {
      wmma::store_matrix_sync(mine, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int e = 0; e < 16 * 16 / 32; ++e) {
        const int idx = e * 32 + lane, r = idx / 16, c = idx % 16;
        const int64_t gr = m0 + warp_row + i * 16 + r, gc = n0 + warp_col + j * 16 + c;
        if (gr < m_end && gc < p.n) {
          float v = mine[idx];
          if (p.bias) v += static_cast<float>(p.bias[group * p.bias_group + gc * p.bias_cols]);
          out[gr * p.out_rows + gc * p.out_cols] = static_cast<scalar_t>(v);
        }
      }
      __syncwarp();
    }
  }
#endif
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

}  // namespace

std::string ragged_gemm_mma_declines(const at::Tensor& a, const at::Tensor& b, bool ragged_k, int64_t groups) {
  if (a.scalar_type() != at::kHalf && a.scalar_type() != at::kBFloat16) return "float16 and bfloat16 only";
  if (at::cuda::getDeviceProperties(a.get_device())->major < 8) return "needs sm_80 or newer";
  return ragged::grid_limits(a.size(0), b.size(-1), groups, ragged_k, kTileM, kTileN);
}

void ragged_gemm_mma_into(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                          const at::Tensor& offsets, bool ragged_k, const at::Tensor& out) {
  const std::string why = ragged_gemm_mma_declines(a, b, ragged_k, offsets.size(0));
  TORCH_INTERNAL_ASSERT(why.empty(), "ragged_gemm_mma_into: ", why);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t n = b.size(-1);
  Pieces pieces{};
  pieces.a_along_k = !ragged_k && a.stride(1) == 1 && a.stride(0) % kPiece == 0 && a.size(1) % kPiece == 0 &&
                     aligned16(a);
  pieces.a_along_m = ragged_k && a.stride(0) == 1 && a.stride(1) % kPiece == 0 && a.size(0) % kPiece == 0 &&
                     aligned16(a);
  pieces.b_along_n = b.stride(-1) == 1 && b.stride(-2) % kPiece == 0 && (ragged_k || b.stride(0) % kPiece == 0) &&
                     n % kPiece == 0 && aligned16(b);
  pieces.b_along_k = !ragged_k && b.stride(-2) == 1 && b.stride(-1) % kPiece == 0 && b.stride(0) % kPiece == 0 &&
                     b.size(-2) % kPiece == 0 && aligned16(b);
  const dim3 grid = ragged::grid_of(a.size(0), n, offsets.size(0), ragged_k, kTileM, kTileN);
  const auto launch = [&](auto scalar) {
    ragged::with_index_type(offsets, [&](auto index) {
      ragged_gemm_mma_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          ragged::make_args<decltype(scalar), decltype(index)>(a, b, bias, offsets, ragged_k, out), pieces);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  a.scalar_type() == at::kHalf ? launch(at::Half()) : launch(at::BFloat16());
}

}  // namespace cuda
}  // namespace patchgemm
