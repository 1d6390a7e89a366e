// Fused weight gradient for patches of at most 64 elements, 16-bit, kw = 2 (the backward of P3's
// Conv3d(4, E, 2) and of U2's ConvTranspose3d(192, 4, 2), whose weight gradient is this one with
// the roles of x and grad_y swapped):
//   dW [E, K] = grad_y^T [E, B*N] @ P [B*N, K],  dbias [E] = grad_y^T @ 1
// (or, for the transpose, its bias gradient: P^T @ 1 summed per channel of x).
// The output is a few thousand numbers and the reduction runs over millions of tokens, so the GEMM
// is pure data movement: grad_y alone is E / K times larger than x. One pass reads grad_y and x once
// each (gather -> cuBLAS writes and re-reads a patch matrix, re-reads grad_y for the bias, and
// reduces per sample where grad_y is channels-first).
//
// Every block walks its share of the 64-token slices (SliceWalk, implicit_patch.cuh; a slice never
// straddles two samples) and owns the whole [E, K] output: 8 warps of mma.sync m16n8k16 over a kStages-deep cp.async
// pipeline (pipelined_main_loop, mma.cuh), each warp the n-tiles w, w + 8, ... of E (balanced across the four
// schedulers) against every m-tile of K. Operand A = P^T, pair-major as in implicit_patch_weight_grad.cu: with kw = 2 a
// patch row (c, i, j) of a token is one 32-bit word of x, and 4 consecutive tokens' words are 16 contiguous bytes.
// Operand B = grad_y, [e][token] in shared memory (channels-first, ldmatrix) or [token][e] (tokens, ldmatrix.trans).
// The embedding's bias gradient is one more m-tile whose A is all ones (every row of the product is then grad_y's
// column sum); the unembedding's (else a separate pass over its whole grad_y) one
// more n-tile whose B is all ones, taken by warps 0 .. kTilesM - 1 (rows of P^T's sums, added per
// channel at the end). Each block writes fp32 partial sums; sum_token_ranges.cu adds them over the
// blocks in a fixed order (deterministic).
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kSlice = 64;              // tokens per pipeline stage
constexpr int kStages = 4;
constexpr int kMaxK = 64, kMaxE = 256;  // up to 4 m-tiles of 16 patch columns, 4 n-tiles per warp
constexpr int kPairPitch = kSlice + 8;  // words; = 8 mod 32: conflict-free 64-bit fragment loads
constexpr int kRowPitch = kSlice + 8;   // elements of a channels-first grad_y row (144 bytes)

// A block's tile: kTilesM x 16 patch columns (K padded up) by kTilesN x 64 embeddings (E padded up:
// warp w owns the n-tiles w, w + 8, ...), both fixed at compile time so the inner loop has no
// bounds checks (padding rows are zeroed once and never loaded).
template <bool kTokensDy, int kTilesM, int kTilesN>
struct Tile {
  static constexpr int kPairs = kTilesM * 8, kRowsE = kTilesN * kWarps * 8;
  static constexpr int kDyPitch = kTokensDy ? kRowsE + 8 : kRowPitch;  // odd counts of 16 bytes
  static constexpr int kBytesA = kPairs * kPairPitch * 4;
  static constexpr int kBytes = kBytesA + (kTokensDy ? kSlice : kRowsE) * kDyPitch * 2;
};

template <typename T, bool kTokensDy, int kTilesM, int kTilesN, BiasGrad kBias>
__global__ void __launch_bounds__(kThreads, 1)
    tiny_weight_grad_kernel(Problem p, FastDiv per_sample, FastDiv gw, FastDiv gh, int slices, const T* __restrict__ x,
                            const T* __restrict__ dy, float* __restrict__ dw_partial, int db_pitch,
                            float* __restrict__ db_partial) {
#if __CUDA_ARCH__ >= 800
  using S = Tile<kTokensDy, kTilesM, kTilesN>;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = smem_address(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  // Padding (pairs past K, embeddings past E) reads as zeros in every slot.
  for (int i = threadIdx.x; i < kStages * S::kBytes / 16; i += kThreads) {
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();

  const int k_tiles = SliceWalk<kSlice>::count(slices);
  SliceWalk<kSlice> slice(per_sample);  // the next slice to load

  // The copies' fixed parts. P^T, pair-major: pairs a_pair + 16 i of tokens 4 a_group ..
  // 4 a_group + 3 (one grid row: gw % 4 == 0).
  const int a_group = threadIdx.x % 16, a_pair = threadIdx.x / 16;
  int pair_offset[(S::kPairs + 15) / 16];
#pragma unroll
  for (int i = 0; i < (S::kPairs + 15) / 16; ++i) {
    pair_offset[i] = 2 * (a_pair + 16 * i) < p.K ? patch_offset(p, 2 * (a_pair + 16 * i)) : -1;
  }
  const int dy_t = threadIdx.x % 8 * 8;  // channels-first: tokens dy_t .. dy_t + 7 of rows threadIdx.x / 8 + 32 i

  auto load_slice = [&](int, int slot) {
    const int b = slice.b, t0 = slice.t0(), count = min(kSlice, p.tokens - t0);
    const uint32_t a_dst = base + slot * S::kBytes, b_dst = a_dst + S::kBytesA;
    // Tokens past the sample read zeros without loads (0 * garbage could be NaN).
    {
      int nw, nh;
      const int nd = gh.divmod(gw.divmod(t0 + 4 * a_group, nw), nh);
      const bool token_valid = 4 * a_group < count;
      const T* origin = x + b * p.stride[0] + int64_t{nd} * p.kd * p.stride[2] + int64_t{nh} * p.kh * p.stride[3] +
                        nw * p.kw;
#pragma unroll
      for (int i = 0; i < (S::kPairs + 15) / 16; ++i) {
        if (a_pair + 16 * i < S::kPairs && pair_offset[i] >= 0) {
          cp_async<16>(a_dst + ((a_pair + 16 * i) * kPairPitch + 4 * a_group) * 4,
                       token_valid ? origin + pair_offset[i] : x, token_valid);
        }
      }
    }
    if constexpr (kTokensDy) {  // rows of tokens, 16-byte pieces of 8 embeddings (E % 8 == 0)
      constexpr int kPieces = S::kRowsE / 8;
      const T* rows = dy + (int64_t{b} * p.tokens + t0) * p.E;
#pragma unroll
      for (int i = 0; i < kSlice * kPieces / kThreads; ++i) {
        const int t = (threadIdx.x + i * kThreads) / kPieces, e = (threadIdx.x + i * kThreads) % kPieces * 8;
        if (e < p.E) cp_async<16>(b_dst + (t * S::kDyPitch + e) * 2, t < count ? rows + t * p.E + e : dy, t < count);
      }
    } else {  // rows of embeddings, 16-byte pieces of 8 tokens (N % 8 == 0)
      const bool valid = dy_t < count;
      const T* row = dy + (int64_t{b} * p.E + threadIdx.x / 8) * p.tokens + t0 + dy_t;
#pragma unroll
      for (int i = 0; i < S::kRowsE / 32; ++i) {
        const int e = threadIdx.x / 8 + 32 * i;
        if (e < p.E)
          cp_async<16>(b_dst + (e * kRowPitch + dy_t) * 2, valid ? row + int64_t{32 * i} * p.tokens : dy, valid);
      }
    }
    slice.next();
  };

  // A fragment of m-tile mi: words [pair mi*8 + g][tokens 2q, 2q + 1] and [.. 2q + 8, 2q + 9]; its
  // rows 0-7 are the pairs' low halves (patch columns 2 pair), rows 8-15 their high halves.
  const unsigned char* a_words = smem + (g * kPairPitch + 2 * q) * 4;
  // B fragment of this warp's n-tile j (embeddings 8 (warp + 8 j) ..): lanes 0-7 address tokens 0-7
  // of the step, 8-15 tokens 8-15.
  const uint32_t b_frag = base + S::kBytesA +
                          (kTokensDy ? ((lane % 16) * S::kDyPitch + warp * 8) * 2
                                     : ((warp * 8 + lane % 8) * kRowPitch + lane / 8 % 2 * 8) * 2);
  uint32_t af[2][kTilesM][4], bf[2][kTilesN][2];
  auto load_fragments = [&](int buf, int slot, int kk) {
#pragma unroll
    for (int mi = 0; mi < kTilesM; ++mi) {
      const unsigned char* a = a_words + slot * S::kBytes + (mi * 8 * kPairPitch + kk) * 4;
      const uint2 lo = *reinterpret_cast<const uint2*>(a), hi = *reinterpret_cast<const uint2*>(a + 8 * 4);
      af[buf][mi][0] = __byte_perm(lo.x, lo.y, 0x5410);  // row g: low halves, tokens 2q, 2q + 1
      af[buf][mi][1] = __byte_perm(lo.x, lo.y, 0x7632);  // row g + 8: high halves
      af[buf][mi][2] = __byte_perm(hi.x, hi.y, 0x5410);  // tokens 2q + 8, 2q + 9
      af[buf][mi][3] = __byte_perm(hi.x, hi.y, 0x7632);
    }
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {
      if constexpr (kTokensDy) {
        ldmatrix_x2_trans(bf[buf][j], b_frag + slot * S::kBytes + (kk * S::kDyPitch + j * kWarps * 8) * 2);
      } else {
        ldmatrix_x2(bf[buf][j], b_frag + slot * S::kBytes + (j * kWarps * 8 * kRowPitch + kk) * 2);
      }
    }
  };

  // The bias gradients: an m-tile (embedding) or n-tile (unembedding) of ones.
  const uint32_t one = pack2<T>(1.f, 1.f);
  const uint32_t ones[4] = {one, one, one, one}, ones_b[2] = {one, one};
  float acc[kTilesM][kTilesN][4] = {}, acc_bias[kTilesN][4] = {}, acc_sums[4] = {};
  pipelined_main_loop<kStages, kSlice>(k_tiles, load_slice, load_fragments, [&](int buf) {
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
      for (int mi = 0; mi < kTilesM; ++mi) mma_16816<T>(acc[mi][j], af[buf][mi], bf[buf][j]);
      if constexpr (kBias == BiasGrad::kEmbed) mma_16816<T>(acc_bias[j], ones, bf[buf][j]);
    }
    if constexpr (kBias == BiasGrad::kUnembed) {
#pragma unroll
      for (int mi = 0; mi < kTilesM; ++mi) {
        if (mi == warp) mma_16816<T>(acc_sums, af[buf][mi], ones_b);
      }
    }
  });

  // acc[mi][j]: patch columns 2 pair (c0, c1) and 2 pair + 1 (c2, c3), pair = mi*8 + g, embeddings
  // 2q (c0, c2) and 2q + 1 (c1, c3) of n-tile j. dw_partial[block] is dW [E][K].
  float* out = dw_partial + int64_t{blockIdx.x} * p.E * p.K;
  float* bias_out = db_partial + int64_t{blockIdx.x} * db_pitch;
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
    const int e = (warp + j * kWarps) * 8 + 2 * q;
    if (e >= p.E) continue;  // E is even (checked on the host): e + 1 < E too
#pragma unroll
    for (int mi = 0; mi < kTilesM; ++mi) {
      const int column = 2 * (mi * 8 + g);
      if (column >= p.K) continue;
      *reinterpret_cast<float2*>(out + int64_t{e} * p.K + column) = {acc[mi][j][0], acc[mi][j][2]};
      *reinterpret_cast<float2*>(out + int64_t{e + 1} * p.K + column) = {acc[mi][j][1], acc[mi][j][3]};
    }
    if (kBias == BiasGrad::kEmbed && g == 0)
      *reinterpret_cast<float2*>(bias_out + e) = {acc_bias[j][0], acc_bias[j][1]};
  }
  if constexpr (kBias == BiasGrad::kUnembed) {
    // acc_sums of warp mi: P^T's row sums, patch columns 2 (mi*8 + g) (c0) and + 1 (c2), through
    // shared memory (the pipeline is done with it) to one thread per channel of x.
    float* column_sums = reinterpret_cast<float*>(smem);
    __syncthreads();
    if (warp < kTilesM && q == 0 && 2 * (warp * 8 + g) < p.K) {
      *reinterpret_cast<float2*>(column_sums + 2 * (warp * 8 + g)) = {acc_sums[0], acc_sums[2]};
    }
    __syncthreads();
    const int volume = p.kd * p.kh * p.kw;
    if (threadIdx.x < p.K / volume) {
      float sum = 0.f;
      for (int k = threadIdx.x * volume; k < (threadIdx.x + 1) * volume; ++k) sum += column_sums[k];
      bias_out[threadIdx.x] = sum;
    }
  }
#endif
}

struct Launch {
  Problem p;
  FastDiv per_sample, gw, gh;
  int slices;
  int64_t blocks;
  const void* x;
  const void* dy;
  float* dw_partial;
  int db_pitch;
  float* db_partial;
};

template <typename T, bool kTokensDy, int kTilesM, int kTilesN, BiasGrad kBias>
void launch(const Launch& a) {
  auto kernel = tiny_weight_grad_kernel<T, kTokensDy, kTilesM, kTilesN, kBias>;
  constexpr int smem = kStages * Tile<kTokensDy, kTilesM, kTilesN>::kBytes;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<static_cast<unsigned>(a.blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      a.p, a.per_sample, a.gw, a.gh, a.slices, static_cast<const T*>(a.x), static_cast<const T*>(a.dy), a.dw_partial,
      a.db_pitch, a.db_partial);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tile shapes built: 2 or 4 m-tiles (K <= 32, 64), 2 to 4 n-tiles per warp (E <= 128, 192, 256).
template <typename T, bool kTokensDy, BiasGrad kBias>
void launch_for_tile(int tiles_m, int tiles_n, const Launch& a) {
  if (tiles_m == 2) {
    tiles_n == 2   ? launch<T, kTokensDy, 2, 2, kBias>(a)
    : tiles_n == 3 ? launch<T, kTokensDy, 2, 3, kBias>(a)
                   : launch<T, kTokensDy, 2, 4, kBias>(a);
  } else {
    tiles_n == 2   ? launch<T, kTokensDy, 4, 2, kBias>(a)
    : tiles_n == 3 ? launch<T, kTokensDy, 4, 3, kBias>(a)
                   : launch<T, kTokensDy, 4, 4, kBias>(a);
  }
}

template <typename T, bool kTokensDy>
void launch_for_bias(BiasGrad bias, int tiles_m, int tiles_n, const Launch& a) {
  bias == BiasGrad::kNone    ? launch_for_tile<T, kTokensDy, BiasGrad::kNone>(tiles_m, tiles_n, a)
  : bias == BiasGrad::kEmbed ? launch_for_tile<T, kTokensDy, BiasGrad::kEmbed>(tiles_m, tiles_n, a)
                             : launch_for_tile<T, kTokensDy, BiasGrad::kUnembed>(tiles_m, tiles_n, a);
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> tiny_weight_grad(const at::Tensor& grad_y, bool tokens,
                                                                   const at::Tensor& x5, const PatchGeometry& g,
                                                                   int64_t E, BiasGrad bias, std::string& why) {
  const int64_t K = g.patch_size(), N = g.tokens();
  const auto dtype = x5.scalar_type();
  Problem p;
  // kw = 2 with 4 tokens of a grid row in one 16-byte copy; 16-byte pieces of grad_y.
  if (dtype != at::kHalf && dtype != at::kBFloat16) return decline_grads(why, "16-bit dtypes only");
  if (g.levels.size() != 1) return decline_grads(why, "row-major token order only (no levels)");
  if (K > kMaxK || E > kMaxE || E % 2)
    return decline_grads(why, "patches of at most 64 elements, E even and at most 256");
  if (tokens ? E % 8 : N % 8)
    return decline_grads(why, tokens ? "E must be a multiple of 8" : "patches per sample must be a multiple of 8");
  if (g.kernel[2] != 2 || g.grid[2] % 4) return decline_grads(why, "kw must be 2 and gw a multiple of 4");
  if (bias == BiasGrad::kUnembed && g.interleaved_channels > 1) {
    return decline_grads(why, "the transposed op's bias gradient over channels-last patches");
  }
  if (x5.stride(4) != 1 || !runs_aligned(x5, 8))
    return decline_grads(why, "x's rows must be contiguous and 16-byte aligned");
  if (at::cuda::getDeviceProperties(x5.get_device())->major < 8) return decline_grads(why, "needs sm_80 or newer");
  if (!make_problem(x5, g, E, p)) return decline_grads(why, "sizes past the kernel's 32-bit indices");
  const c10::cuda::CUDAGuard guard(x5.device());
  const int64_t bias_size = bias == BiasGrad::kEmbed ? E : bias == BiasGrad::kUnembed ? g.channels : 0;
  if (g.batch * N == 0 || E == 0) {
    return std::make_tuple(at::zeros({E, K}, x5.options()),
                           bias == BiasGrad::kNone ? at::Tensor() : at::zeros({bias_size}, x5.options()));
  }
  const at::Tensor dy = contiguous_aligned(grad_y);
  const int64_t slices = g.batch * ((N + kSlice - 1) / kSlice);
  if (slices >= INT_MAX) return decline_grads(why, "too many patches for 32-bit indices");
  const int64_t blocks = std::min<int64_t>(slices, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  // fp32 partial sums per block, rows of whole float4s for sum_token_ranges (E * K % 4 == 0: both even;
  // the bias rows' padding is zero, summed and dropped).
  const int64_t db_pitch = (bias_size + 3) / 4 * 4;
  const auto f32 = x5.options().dtype(at::kFloat);
  const at::Tensor dw_partial = at::empty({blocks, E * K}, f32);
  const at::Tensor db_partial =
      db_pitch > bias_size ? at::zeros({blocks, db_pitch}, f32) : at::empty({blocks, db_pitch}, f32);
  const int tiles_m = K <= 32 ? 2 : 4, tiles_n = E <= 128 ? 2 : E <= 192 ? 3 : 4;
  const Launch a{p,
                 FastDiv(static_cast<uint32_t>((N + kSlice - 1) / kSlice)),
                 FastDiv(static_cast<uint32_t>(g.grid[2])),
                 FastDiv(static_cast<uint32_t>(g.grid[1])),
                 static_cast<int>(slices),
                 blocks,
                 x5.const_data_ptr(),
                 dy.const_data_ptr(),
                 dw_partial.data_ptr<float>(),
                 static_cast<int>(db_pitch),
                 db_partial.data_ptr<float>()};
  if (dtype == at::kHalf) {
    tokens ? launch_for_bias<__half, true>(bias, tiles_m, tiles_n, a)
           : launch_for_bias<__half, false>(bias, tiles_m, tiles_n, a);
  } else {
    tokens ? launch_for_bias<__nv_bfloat16, true>(bias, tiles_m, tiles_n, a)
           : launch_for_bias<__nv_bfloat16, false>(bias, tiles_m, tiles_n, a);
  }
  const at::Tensor grad_w = at::empty({E, K}, x5.options());
  const at::Tensor grad_b = bias == BiasGrad::kNone ? at::Tensor() : at::empty({db_pitch}, x5.options());
  sum_token_ranges(dw_partial, db_partial, grad_w, grad_b);
  return std::make_tuple(grad_w, grad_b.defined() ? grad_b.narrow(0, 0, bias_size) : grad_b);
}

}  // namespace cuda
}  // namespace patchgemm
