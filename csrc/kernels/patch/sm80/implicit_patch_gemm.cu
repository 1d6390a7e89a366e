// Implicit-GEMM patch embedding, 16-bit dtypes: y = patches(x) @ W^T (+ bias) with the patches read
// straight from x inside the GEMM's main loop, so no patch matrix ever reaches global memory. (The
// gather -> GEMM path writes and re-reads one as large as x: for P4 that is most of its time.)
//
// The GEMM is (B*N tokens) x E x (K = C*kd*kh*kw). A block computes 128 tokens x kTileN (128 or 192)
// embeddings with 8 warps (2 x 4; mma.sync m16n8k16, fp32 accumulation, fragments double-buffered)
// over a 3-stage cp.async pipeline of 64-wide K slices. The A operand is the trick: with kw even,
// the kw elements of one patch row (c, i, j) are contiguous in x and sit at consecutive k in the
// weight's K order (c, i, j, l). So a token's K slice is a few aligned runs of x (V = 2, 4 or 8
// elements) that cp.async copies straight into a K-major shared tile, which ldmatrix feeds to the
// tensor cores like any row-major operand. Eight consecutive tokens of a patch row are adjacent
// runs: a warp's copies are whole sectors. Where each token's patch starts, and where each run sits
// in a patch, are tabulated in shared memory once per block, so the main loop does no index math.
// The epilogue adds the bias in fp32, rounds once, stages the tile in shared memory and writes the
// final layout, tokens [B, N, E] or channels-first [B, E, N], in coalesced vectors.
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

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kTileM = 128;         // tokens per block
constexpr int kTileK = 64;          // K per pipeline stage
constexpr int kStages = 3;
constexpr int kPitch = kTileK + 8;  // shared row pitch in elements (144 bytes): conflict-free ldmatrix
constexpr int kMaxRuns = 16384;     // entries of the run-offset table (64 KB of shared memory)

template <typename T, int kTileN, int V, bool kPairMajor>
__global__ void __launch_bounds__(kThreads) implicit_embed_kernel(Problem p, const T* __restrict__ x,
                                                                  const T* __restrict__ w,
                                                                  const T* __restrict__ bias, bool tokens_out,
                                                                  T* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
  constexpr int kWarpN = kTileN / 4, kTilesN = kWarpN / 8;  // a warp: 64 tokens x kWarpN embeddings
  constexpr int kRuns = kTileK / V;                         // runs per token and K slice
  constexpr int kRunGroups = kRuns / 4;                     // lanes: 8 tokens x 4 runs
  constexpr int kLoadsA = kTileM / 8 * kRunGroups / kWarps;  // runs each thread copies per slice
  constexpr int kTokenStep = kWarps / kRunGroups * 8;        // between one thread's tokens
  constexpr int kLoadsB = kTileN * kTileK / 8 / kThreads;    // 16-byte pieces of W per thread
  static_assert(kWarps % kRunGroups == 0 && kLoadsA >= 1 && kTileN * kTileK / 8 % kThreads == 0 &&
                kTilesN % 2 == 0);
  // Pair-major A (kw = 2 with groups of 4 tokens 16-byte aligned): a slot of sA holds 32-bit words
  // [pair][token], so one 16-byte copy moves the pair (c, i, j) of 4 consecutive tokens (4x fewer
  // copies than 4-byte runs, which throttle the load queue) and fragments come from 32-bit loads.
  constexpr int kPairPitch = kTileM + 8;  // words; = 8 mod 32: conflict-free fragment loads
  static_assert(!kPairMajor || (V == 2 && kRuns % kWarps == 0 && kRuns * kPairPitch * 4 <= kTileM * kPitch * 2));
  extern __shared__ __align__(128) unsigned char smem[];
  int64_t* token_origin = reinterpret_cast<int64_t*>(smem);  // [kTileM] (not pair-major)
  T* sA = reinterpret_cast<T*>(token_origin + kTileM);       // [kStages][kTileM][kPitch]: tokens x K slice
  T* sB = sA + kStages * kTileM * kPitch;                    // [kStages][kTileN][kPitch]: embeddings x K slice
  int* run_offset = reinterpret_cast<int*>(sB + kStages * kTileN * kPitch);  // [k_tiles * kRuns]; -1: past K

  const int tiles_n = (p.E + kTileN - 1) / kTileN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x / tiles_n) * kTileM;
  const int e0 = static_cast<int>(blockIdx.x % tiles_n) * kTileN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_tiles = (p.ldw + kTileK - 1) / kTileK;

  // Tokens past the end read the last real ones and embeddings past E read zeros (without loads:
  // clamped rows of W would all hit one line): their results are never stored.
  for (int r = threadIdx.x; r < k_tiles * kRuns; r += kThreads)
    run_offset[r] = r * V < p.K ? patch_offset(p, r * V) : -1;
  if (!kPairMajor && threadIdx.x < kTileM)
    token_origin[threadIdx.x] = patch_origin(p, min(m0 + threadIdx.x, p.rows - 1));
  __syncthreads();

  // A: this thread copies run `run` of every K slice for kLoadsA tokens, kTokenStep apart.
  const int run = warp % kRunGroups * 4 + lane / 8, first_token = warp / kRunGroups * 8 + lane % 8;
  const T* a_src[kLoadsA];
#pragma unroll
  for (int i = 0; i < kLoadsA; ++i) a_src[i] = x + token_origin[first_token + i * kTokenStep];
  const uint32_t a_dst = smem_address(sA + first_token * kPitch + run * V);
  // Pair-major: this thread copies pairs warp + 8 i of tokens 4 lane .. 4 lane + 3.
  const T* group_src = x + (kPairMajor ? patch_origin(p, min(m0 + 4 * lane, p.rows - 4)) : 0);
  const uint32_t group_dst = smem_address(sA) + (warp * kPairPitch + 4 * lane) * 4;
  // B: 16-byte pieces at column b_col of rows b_row + 32 i.
  const int b_col = threadIdx.x % 8 * 8, b_row = threadIdx.x / 8;
  const T* b_src[kLoadsB];
  bool b_valid[kLoadsB];
#pragma unroll
  for (int i = 0; i < kLoadsB; ++i) {
    b_valid[i] = e0 + b_row + 32 * i < p.E;
    b_src[i] = w + int64_t{min(e0 + b_row + 32 * i, p.E - 1)} * p.ldw + b_col;
  }
  const uint32_t b_dst = smem_address(sB + b_row * kPitch + b_col);

  auto load_slice = [&](int kt, int slot) {
    if constexpr (kPairMajor) {
#pragma unroll
      for (int i = 0; i < kRuns / kWarps; ++i) {
        const int offset = run_offset[kt * kRuns + warp + i * kWarps];
        cp_async<16>(group_dst + slot * kTileM * kPitch * 2 + i * kWarps * kPairPitch * 4, group_src + max(offset, 0),
                     offset >= 0);
      }
    } else {
      const int offset = run_offset[kt * kRuns + run];
#pragma unroll
      for (int i = 0; i < kLoadsA; ++i) {
        cp_async<V * 2>(a_dst + (slot * kTileM + i * kTokenStep) * kPitch * 2, a_src[i] + max(offset, 0), offset >= 0);
      }
    }
    const int col = kt * kTileK;
    const bool in_w = col + b_col < p.ldw;
#pragma unroll
    for (int i = 0; i < kLoadsB; ++i) {
      cp_async<16>(b_dst + (slot * kTileN + 32 * i) * kPitch * 2, b_src[i] + (in_w ? col : 0), in_w && b_valid[i]);
    }
  };

  const int wm = warp / 4, wn = warp % 4;
  const uint32_t a_frag = smem_address(sA + (wm * 64 + lane % 16) * kPitch + lane / 16 * 8);
  const uint32_t b_frag = smem_address(sB + (wn * kWarpN + lane / 16 * 8 + lane % 8) * kPitch + lane / 8 % 2 * 8);
  const uint32_t* a_words = reinterpret_cast<const uint32_t*>(sA) + lane % 4 * kPairPitch + wm * 64 + lane / 4;
  uint32_t af[2][4][4], bf[2][kTilesN][2];
  auto load_fragments = [&](int buf, int slot, int kk) {
    if constexpr (kPairMajor) {  // a0..a3: (token g, pair q), (g + 8, q), (g, q + 4), (g + 8, q + 4)
      const uint32_t* a = a_words + slot * (kTileM * kPitch / 2) + kk / 2 * kPairPitch;
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        af[buf][mi][0] = a[mi * 16];
        af[buf][mi][1] = a[mi * 16 + 8];
        af[buf][mi][2] = a[4 * kPairPitch + mi * 16];
        af[buf][mi][3] = a[4 * kPairPitch + mi * 16 + 8];
      }
    } else {
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) ldmatrix_x4(af[buf][mi], a_frag + ((slot * kTileM + mi * 16) * kPitch + kk) * 2);
    }
#pragma unroll
    for (int j = 0; j < kTilesN; j += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, b_frag + ((slot * kTileN + j * 8) * kPitch + kk) * 2);
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
  __syncthreads();  // the pipeline's shared memory becomes the output stage

  // acc[mi][j]: tokens g and g + 8 of m-tile mi, embeddings 2q and 2q + 1 of n-tile j.
  const EmbedEpilogue<kTileM, kTileN> epilogue{reinterpret_cast<uint16_t*>(sA), tokens_out};
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
    const int n = wn * kWarpN + j * 8 + 2 * q, e = e0 + n;
    const float bias_lo = bias && e < p.E ? to_float(bias[e]) : 0.f;
    const float bias_hi = bias && e + 1 < p.E ? to_float(bias[e + 1]) : 0.f;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        epilogue.put(wm * 64 + mi * 16 + g + half * 8, n,
                     pack2<T>(acc[mi][j][2 * half] + bias_lo, acc[mi][j][2 * half + 1] + bias_hi));
      }
    }
  }
  __syncthreads();
  epilogue.template write<kThreads>(p, m0, e0, reinterpret_cast<uint16_t*>(y));
#endif
}

template <typename T, int kTileN, int V, bool kPairMajor = false>
bool launch(const Problem& p, const at::Tensor& x5, const at::Tensor& w, const std::optional<at::Tensor>& bias,
            bool tokens_out, const at::Tensor& y) {
  const int64_t runs = (p.ldw + kTileK - 1) / kTileK * (kTileK / V);
  const int64_t smem = kTileM * 8 + kStages * (kTileM + kTileN) * kPitch * 2 + runs * 4;
  if (runs > kMaxRuns || smem > at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) return false;
  auto kernel = implicit_embed_kernel<T, kTileN, V, kPairMajor>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
  const int64_t blocks = (p.rows + kTileM - 1) / kTileM * ((p.E + kTileN - 1) / kTileN);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(w.const_data_ptr()),
      bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr, tokens_out, static_cast<T*>(y.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, int kTileN>
bool launch_for_runs(int run, bool pair_major, const Problem& p, const at::Tensor& x5, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, bool tokens_out, const at::Tensor& y) {
  switch (run) {
    case 8: return launch<T, kTileN, 8>(p, x5, w, bias, tokens_out, y);
    case 4: return launch<T, kTileN, 4>(p, x5, w, bias, tokens_out, y);
    default:
      return pair_major ? launch<T, kTileN, 2, true>(p, x5, w, bias, tokens_out, y)
                        : launch<T, kTileN, 2>(p, x5, w, bias, tokens_out, y);
  }
}

}  // namespace

bool implicit_embed_mma(const Problem& p, int run, bool pair_major, const at::Tensor& x5, const at::Tensor& w,
                        const std::optional<at::Tensor>& b, bool tokens_out, const at::Tensor& y) {
  // 192-wide tiles where E is a multiple (ViT-B's 768, the hMLP stems' 192): fewer W re-reads per
  // token and no idle columns; 128 otherwise.
  const bool wide = p.E % 192 == 0;
  if (x5.scalar_type() == at::kHalf) {
    return wide ? launch_for_runs<__half, 192>(run, pair_major, p, x5, w, b, tokens_out, y)
                : launch_for_runs<__half, 128>(run, pair_major, p, x5, w, b, tokens_out, y);
  } else {
    return wide ? launch_for_runs<__nv_bfloat16, 192>(run, pair_major, p, x5, w, b, tokens_out, y)
                : launch_for_runs<__nv_bfloat16, 128>(run, pair_major, p, x5, w, b, tokens_out, y);
  }
}

}  // namespace cuda
}  // namespace patchgemm
