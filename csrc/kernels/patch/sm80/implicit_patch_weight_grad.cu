// Implicit-GEMM weight gradient of the patch embedding, 16-bit dtypes, kw = 2:
//   dW [E, K] = grad_y^T [E, B*N] @ P [B*N, K]
// with P read straight from x inside the GEMM's main loop. (The gather it replaces writes and
// re-reads a patch matrix as large as x: with the scatter, most of P4's backward.) Its entry,
// implicit_weight_grad (implicit/implicit_weight_grad.cu), checks the problem, splits the tokens
// into ranges and runs this kernel or the Hopper ones.
//
// The block computes dW^T [K, E] = P^T @ grad_y for 128 patch columns x kTileN (128 or 192)
// embeddings over a range of tokens, the reduction dimension. The output is small and the reduction
// long, so the tokens are split into ranges, one per block, until every SM has one; each block
// writes fp32 partial sums and one sum over the ranges finishes (deterministic, unlike atomics).
// 8 warps (2 x 4) of mma.sync m16n8k16 with fp32 accumulation over a 3-stage cp.async pipeline of
// 64-token slices, fragments double-buffered, as in the forward (implicit_patch_gemm.cu).
//
// Operand A = P^T. With kw = 2 each patch row (c, i, j) of a token is one 32-bit word of x (a
// "pair": patch columns 2p and 2p + 1), and the pairs of 4 consecutive tokens are 16 contiguous
// bytes. So x is copied pair-major, words [pair][token], one 16-byte copy per 4 tokens. An mma
// row needs two consecutive tokens of one patch column: the same half of two adjacent words. So
// the 16 rows of an m-tile are 8 pairs' low halves (rows 0-7) then their high halves (rows 8-15):
// a lane's rows g and g + 8 are the two halves of the same words, and each A register is a byte
// permute of one 64-bit shared load. Operand B = grad_y: channels-first [B, E, N] is [e][token] in
// shared memory (ldmatrix), tokens [B*N, E] is [token][e] (ldmatrix.trans).
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileM = 128, kPairs = kTileM / 2;  // patch columns (pairs) per block
constexpr int kTileK = 64;                        // tokens per pipeline stage
constexpr int kStages = 3;
static_assert(kTileM == kWeightGradColumns && kTileK == kWeightGradTokens, "implicit_weight_grad's split");
constexpr int kPairPitch = kTileK + 8;  // words; = 8 mod 32: conflict-free 64-bit fragment loads
constexpr int kPitch = kTileK + 8;      // elements of a channels-first grad_y row (144 bytes)

template <typename T, int kTileN, bool kTokensDy>
__global__ void __launch_bounds__(kThreads) implicit_weight_grad_kernel(Problem p, const T* __restrict__ x,
                                                                        const T* __restrict__ dy, int64_t chunk,
                                                                        float* __restrict__ partial) {
#if __CUDA_ARCH__ >= 800
  constexpr int kWarpN = kTileN / 4, kTilesN = kWarpN / 8;  // a warp: 32 pairs x kWarpN embeddings
  constexpr int kDyPitch = kTokensDy ? kTileN + 8 : kPitch;  // = 4 mod 32 words: conflict-free ldmatrix
  constexpr int kSlotA = kPairs * kPairPitch * 4;             // bytes per stage
  constexpr int kSlotB = (kTokensDy ? kTileK : kTileN) * kDyPitch * 2;
  constexpr int kLoadsA = kPairs * kTileK / 4 / kThreads;  // 16-byte copies of x per thread and stage
  constexpr int kLoadsB = kTileN * kTileK / 8 / kThreads;  // 16-byte copies of grad_y
  constexpr int kVectorsN = kTileN / 8;                     // 16-byte pieces of a tokens grad_y row
  static_assert(kLoadsA * kThreads * 4 == kPairs * kTileK && kLoadsB * kThreads * 8 == kTileN * kTileK &&
                kTilesN % 2 == 0);
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sA = smem_address(smem), sB = sA + kStages * kSlotA;

  const int tiles_n = (p.E + kTileN - 1) / kTileN, tiles_m = (p.K + kTileM - 1) / kTileM;
  const int e0 = static_cast<int>(blockIdx.x % tiles_n) * kTileN;
  const int pair0 = static_cast<int>(blockIdx.x / tiles_n % tiles_m) * kPairs;
  const int64_t split = blockIdx.x / tiles_n / tiles_m;
  const int64_t t_begin = split * chunk, t_end = min(t_begin + chunk, p.rows);
  const int k_tiles = static_cast<int>((t_end - t_begin + kTileK - 1) / kTileK);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // A: this thread copies pairs a_pair + 16 i of tokens 4 a_group .. 4 a_group + 3 of each slice.
  // Whatever lies past K, E or the token range reads zeros, without loads (cp.async zero-fill):
  // tokens are the reduction, and clamped rows would all hit one line.
  const int a_group = threadIdx.x % 16, a_pair = threadIdx.x / 16;
  int pair_offset[kLoadsA];
  bool pair_valid[kLoadsA];
#pragma unroll
  for (int i = 0; i < kLoadsA; ++i) {
    pair_valid[i] = pair0 + a_pair + 16 * i < p.K / 2;
    pair_offset[i] = patch_offset(p, 2 * min(pair0 + a_pair + 16 * i, p.K / 2 - 1));
  }
  const uint32_t a_dst = sA + (a_pair * kPairPitch + 4 * a_group) * 4;
  // B, channels-first: 8 tokens (b_token ..) of embedding rows b_row + 32 i. Tokens: 8 embeddings
  // (b_col[i] ..) of token rows b_token[i].
  int64_t b_row_offset[kLoadsB];
  int b_token[kLoadsB];
  uint32_t b_dst[kLoadsB];
  bool b_valid[kLoadsB];
#pragma unroll
  for (int i = 0; i < kLoadsB; ++i) {
    if constexpr (kTokensDy) {
      const int v = threadIdx.x + kThreads * i, col = v % kVectorsN * 8;
      b_token[i] = v / kVectorsN;
      b_valid[i] = e0 + col < p.E;  // E % 8 == 0
      b_row_offset[i] = min(e0 + col, p.E - 8);
      b_dst[i] = sB + (b_token[i] * kDyPitch + col) * 2;
    } else {
      const int row = threadIdx.x / 8 + 32 * i;
      b_token[i] = threadIdx.x % 8 * 8;
      b_valid[i] = e0 + row < p.E;
      b_row_offset[i] = int64_t{min(e0 + row, p.E - 1)} * p.tokens;
      b_dst[i] = sB + (row * kPitch + b_token[i]) * 2;
    }
  }

  auto load_slice = [&](int kt, int slot) {
    const int64_t t0 = t_begin + int64_t{kt} * kTileK;
    {
      const int64_t token = t0 + 4 * a_group;
      const bool valid = token < t_end;
      const T* src = x + patch_origin(p, valid ? token : t_begin);
#pragma unroll
      for (int i = 0; i < kLoadsA; ++i) {
        cp_async<16>(a_dst + slot * kSlotA + i * 16 * kPairPitch * 4, src + pair_offset[i], valid && pair_valid[i]);
      }
    }
    if constexpr (kTokensDy) {
#pragma unroll
      for (int i = 0; i < kLoadsB; ++i) {
        const int64_t token = t0 + b_token[i];
        const bool valid = token < t_end;
        cp_async<16>(b_dst[i] + slot * kSlotB, dy + (valid ? token : t_begin) * p.E + b_row_offset[i],
                     valid && b_valid[i]);
      }
    } else {  // the 8 tokens of a piece share a sample: tokens % 8 == 0 (checked on the host)
      const int64_t token = t0 + b_token[0];
      const bool valid = token < t_end;
      const int64_t b = (valid ? token : t_begin) / p.tokens;
      const T* src = dy + b * p.E * p.tokens + ((valid ? token : t_begin) - b * p.tokens);
#pragma unroll
      for (int i = 0; i < kLoadsB; ++i)
        cp_async<16>(b_dst[i] + slot * kSlotB, src + b_row_offset[i], valid && b_valid[i]);
    }
  };

  const int wm = warp / 4, wn = warp % 4, g = lane / 4, q = lane % 4;
  // A fragment of m-tile mi: words [pair wm*32 + mi*8 + g][tokens 2q, 2q + 1] and [.. 2q + 8, 2q + 9].
  const unsigned char* a_words = smem + ((wm * 32 + g) * kPairPitch + 2 * q) * 4;
  const uint32_t b_frag = kTokensDy ? sB + ((lane / 8 % 2 * 8 + lane % 8) * kDyPitch + wn * kWarpN + lane / 16 * 8) * 2
                                    : sB + ((wn * kWarpN + lane / 16 * 8 + lane % 8) * kPitch + lane / 8 % 2 * 8) * 2;
  uint32_t af[2][4][4], bf[2][kTilesN][2];
  auto load_fragments = [&](int buf, int slot, int kk) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const unsigned char* a = a_words + slot * kSlotA + (mi * 8 * kPairPitch + kk) * 4;
      const uint2 lo = *reinterpret_cast<const uint2*>(a), hi = *reinterpret_cast<const uint2*>(a + 8 * 4);
      af[buf][mi][0] = __byte_perm(lo.x, lo.y, 0x5410);  // (row g: column 2p, tokens 2q, 2q + 1)
      af[buf][mi][1] = __byte_perm(lo.x, lo.y, 0x7632);  // (row g + 8: column 2p + 1)
      af[buf][mi][2] = __byte_perm(hi.x, hi.y, 0x5410);  // tokens 2q + 8, 2q + 9
      af[buf][mi][3] = __byte_perm(hi.x, hi.y, 0x7632);
    }
#pragma unroll
    for (int j = 0; j < kTilesN; j += 2) {
      uint32_t r[4];
      if constexpr (kTokensDy) {
        ldmatrix_x4_trans(r, b_frag + slot * kSlotB + (kk * kDyPitch + j * 8) * 2);
      } else {
        ldmatrix_x4(r, b_frag + slot * kSlotB + (j * 8 * kPitch + kk) * 2);
      }
      bf[buf][j][0] = r[0], bf[buf][j][1] = r[1], bf[buf][j + 1][0] = r[2], bf[buf][j + 1][1] = r[3];
    }
  };

  float acc[4][kTilesN][4] = {};
  pipelined_main_loop<kStages, kTileK>(k_tiles, load_slice, load_fragments, [&](int buf) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) mma_16816<T>(acc[mi][j], af[buf][mi], bf[buf][j]);
    }
  });

  // acc[mi][j]: columns 2p (c0, c1) and 2p + 1 (c2, c3) of pair p, embeddings 2q (c0, c2) and
  // 2q + 1 (c1, c3) of n-tile j. partial[split][e][column], column pairs as float2.
  float* out = partial + split * p.E * p.K;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
    const int column = 2 * (pair0 + wm * 32 + mi * 8 + g);
    if (column >= p.K) continue;
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {
      const int e = e0 + wn * kWarpN + j * 8 + 2 * q;
      if (e < p.E) *reinterpret_cast<float2*>(out + int64_t{e} * p.K + column) = {acc[mi][j][0], acc[mi][j][2]};
      if (e + 1 < p.E) *reinterpret_cast<float2*>(out + int64_t{e + 1} * p.K + column) = {acc[mi][j][1], acc[mi][j][3]};
    }
  }
#endif
}

template <typename T, int kTileN, bool kTokensDy>
void launch(const Problem& p, const at::Tensor& x5, const at::Tensor& dy, int64_t splits, int64_t chunk,
            const at::Tensor& partial) {
  constexpr int64_t smem =
      kStages * (kPairs * kPairPitch * 4 + (kTokensDy ? kTileK * (kTileN + 8) : kTileN * kPitch) * 2);
  auto kernel = implicit_weight_grad_kernel<T, kTileN, kTokensDy>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
  const int64_t blocks = splits * ((p.K + kTileM - 1) / kTileM) * ((p.E + kTileN - 1) / kTileN);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(dy.const_data_ptr()), chunk,
      partial.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int kTileN>
void launch_for_layout(bool tokens, const Problem& p, const at::Tensor& x5, const at::Tensor& dy, int64_t splits,
                       int64_t chunk, const at::Tensor& partial) {
  tokens ? launch<T, kTileN, true>(p, x5, dy, splits, chunk, partial)
         : launch<T, kTileN, false>(p, x5, dy, splits, chunk, partial);
}

}  // namespace

void implicit_weight_grad_mma(const Problem& p, bool tokens, const at::Tensor& x5, const at::Tensor& dy,
                              int64_t splits, int64_t chunk, const at::Tensor& partial) {
  const bool half = x5.scalar_type() == at::kHalf;
  if (p.E % 192 == 0) {  // (as the forward's tiles)
    half ? launch_for_layout<__half, 192>(tokens, p, x5, dy, splits, chunk, partial)
         : launch_for_layout<__nv_bfloat16, 192>(tokens, p, x5, dy, splits, chunk, partial);
  } else {
    half ? launch_for_layout<__half, 128>(tokens, p, x5, dy, splits, chunk, partial)
         : launch_for_layout<__nv_bfloat16, 128>(tokens, p, x5, dy, splits, chunk, partial);
  }
}

}  // namespace cuda
}  // namespace patchgemm
