// Implicit-GEMM patch unembedding on Hopper (sm_90a), kw = 2 or 4: the GEMM of
// implicit_patch_unembed.cu, which explains it (tokens x patch columns x C_in, the output tile
// scattered into y from the epilogue), with warpgroup MMAs (wgmma) in place of mma.sync, as the
// forward's implicit_patch_gemm_sm90.cu. A patch row of y is a run of kw elements, and the runs of
// consecutive tokens are adjacent: the epilogue stores 16 bytes = the runs of 8 / kw tokens.
//
// A block: 128 tokens x 128 patch columns, two warpgroups of 64 tokens each, two blocks per SM, over
// wgmma_main_loop's cp.async pipeline of 64-channel slices, every operand a 128B-swizzled tile:
//   - W^T [K, C_in] (B operand): rows are patch columns, K-major.
//   - x tokens [B*N, C_in] (A): rows are tokens, K-major.
//   - x channels-first [B, C_in, N] (A): rows are channels, each warpgroup's 64 tokens one 128-byte
//     row (M-major; 8 tokens of a sample per copy: N % 8 == 0).
#include <ATen/ATen.h>

#include "patchify.h"

#ifndef USE_ROCM
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "cuda/implicit_patch.cuh"
#include "cuda/mma.cuh"
#include "cuda/wgmma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;                           // two warpgroups
constexpr int kTileM = 128;                             // tokens per block, 64 per warpgroup
constexpr int kTileK = 64;                              // input channels per slice
constexpr int kStages = 3;  // C_in is short (P4: 3 slices); two blocks per SM overlap one's stores
                             // with the other's loads
constexpr int kTileN = 128;  // patch columns per block
constexpr int kSlotA = kTileM * 128, kSlot = kSlotA + kTileN * 128;  // bytes of a pipeline slot
// Runs of the output stage's [run][token] rows: kw = 2, words = 8 mod 32; kw = 4, 8-byte runs:
// 16 mod 32 words. Conflict-free either way.
constexpr int kStagePitch = kTileM + 8;

// p describes y (the volume the patches tile) with p.E = C_in, the reduction, and p.ldw the row
// length of wt = W^T [K, ldw] (C_in rounded up to 8, zero columns). kRun = p.kw.
template <typename T, bool kTokensIn, int kRun>
__global__ void __launch_bounds__(kThreads, 2)
    implicit_unembed_kernel_sm90(Problem p, const T* __restrict__ x, const T* __restrict__ wt,
                                 const T* __restrict__ bias, T* __restrict__ y) {
#ifdef PATCHGEMM_HAS_WGMMA
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;  // the launch adds the slack
  unsigned char* smem = smem_raw + (base - raw);

  const int tiles_n = (p.K + kTileN - 1) / kTileN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x / tiles_n) * kTileM;
  const int col0 = static_cast<int>(blockIdx.x % tiles_n) * kTileN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_tiles = (p.ldw + kTileK - 1) / kTileK;

  // A, tokens in: x's rows m0 .. m0 + 127. Channels-first: pieces of 8 tokens (a sample's) at token
  // a_col of channel rows a_row + 16 i, into warpgroup a_col / 64's M-major tile (8 KB). Tokens
  // past the end read the last real ones (never stored); channels past C_in read zeros.
  const SwizzledRowCopies<T, kTileM, kThreads> a_rows(x, kTokensIn ? p.rows : 0, p.E, m0);
  const int a_col = threadIdx.x % 16 * 8, a_row = threadIdx.x / 16;
  const T* a_src[4];
  if constexpr (!kTokensIn) {
    const int64_t token = min(m0 + a_col, p.rows - 8), b = token / p.tokens;
#pragma unroll
    for (int i = 0; i < 4; ++i) a_src[i] = x + (b * p.E + min(a_row + 16 * i, p.E - 1)) * p.tokens + (token - b * p.tokens);
  }
  const uint32_t a_dst = a_col / 64 * 8192 + swizzle_128b(a_row, a_col % 64 * 2);
  // B: W^T's rows (patch columns) col0 .. col0 + kTileN - 1.
  const SwizzledRowCopies<T, kTileN, kThreads> b_copies(wt, p.K, p.ldw, col0);

  auto load_slice = [&](int kt, int slot) {
    const uint32_t slot_base = base + slot * kSlot;
    const int e0 = kt * kTileK;
    if constexpr (kTokensIn) {
      a_rows.copy(slot_base, e0);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool valid = e0 + a_row + 16 * i < p.E;
        cp_async<16>(slot_base + a_dst + 16 * i * 128, a_src[i] + (valid ? int64_t{e0} * p.tokens : 0), valid);
      }
    }
    b_copies.copy(slot_base + kSlotA, e0);
  };

  const int wg = warp / 4, wq = warp % 4;
  float acc[kTileN / 2];
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;

  wgmma_main_loop<kStages>(k_tiles, load_slice, [&](int slot) {
    fence_accumulators(acc);
    const uint32_t slot_base = base + slot * kSlot;
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kTileK / 16; ++t) {
      // A: K-major steps 32 bytes along a row; M-major ones 2048 bytes (16 rows of channels).
      const uint32_t a = slot_base + (kTokensIn ? wg * 64 * 128 + 32 * t : wg * 8192 + 2048 * t);
      wgmma_ss<T, kTileN, !kTokensIn>(acc, smem_descriptor_128b(a), smem_descriptor_128b(slot_base + kSlotA + 32 * t));
    }
    wgmma_commit();
    fence_accumulators(acc);
  });
  fence_accumulators(acc);  // the pipeline's shared memory becomes the output stage

  // acc[4 j + 2 half + i]: token wg*64 + wq*16 + g + 8 half, column 8 j + 2 q + i: one word of
  // run (8 j + 2 q) / kRun. The bias is per output channel: column / (kd * kh * kw).
  constexpr int kWordsPerRun = kRun / 2;
  uint32_t* stage = reinterpret_cast<uint32_t*>(smem);
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
    const int column = 8 * j + 2 * q, run = column / kRun;
    const float b = bias ? to_float(bias[min(col0 + column, p.K - 1) / (p.kd * p.kh * p.kw)]) : 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int token = wg * 64 + wq * 16 + g + half * 8;
      stage[(run * kStagePitch + token) * kWordsPerRun + column % kRun / 2] =
          pack2<T>(acc[4 * j + 2 * half] + b, acc[4 * j + 2 * half + 1] + b);
    }
  }
  __syncthreads();
  // 16-byte stores: this thread's kGroup tokens kGroup * group .. (one patch-grid row: gw % kGroup
  // == 0) of runs first_run + kRunStep i.
  constexpr int kGroup = 8 / kRun, kGroups = kTileM / kGroup, kRunStep = kThreads / kGroups;
  const int group = threadIdx.x % kGroups, first_run = threadIdx.x / kGroups;
  const int64_t token = m0 + kGroup * group;
  if (token >= p.rows) return;
  T* origin = y + patch_origin(p, token);
#pragma unroll
  for (int i = 0; i < kTileN / kRun / kRunStep; ++i) {
    const int run = first_run + kRunStep * i;
    if (col0 + kRun * run >= p.K) break;
    *reinterpret_cast<uint4*>(origin + patch_offset(p, col0 + kRun * run)) =
        *reinterpret_cast<const uint4*>(stage + (run * kStagePitch + kGroup * group) * kWordsPerRun);
  }
#endif
}

template <typename T, bool kTokensIn, int kRun>
bool launch(const Problem& p, const at::Tensor& x, const at::Tensor& wt, const std::optional<at::Tensor>& bias,
            const at::Tensor& y5) {
  constexpr int smem = 1024 + kStages * kSlot;
  static_assert(kTileN / kRun * kStagePitch * kRun * 2 <= kStages * kSlot);
  if (smem > at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) return false;
  auto kernel = implicit_unembed_kernel_sm90<T, kTokensIn, kRun>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t blocks = (p.rows + kTileM - 1) / kTileM * ((p.K + kTileN - 1) / kTileN);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const T*>(x.const_data_ptr()), static_cast<const T*>(wt.const_data_ptr()),
      bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr, static_cast<T*>(y5.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T>
bool launch_for_layout(bool tokens, const Problem& p, const at::Tensor& x, const at::Tensor& wt,
                       const std::optional<at::Tensor>& bias, const at::Tensor& y5) {
  if (p.kw == 4) return tokens ? launch<T, true, 4>(p, x, wt, bias, y5) : launch<T, false, 4>(p, x, wt, bias, y5);
  return tokens ? launch<T, true, 2>(p, x, wt, bias, y5) : launch<T, false, 2>(p, x, wt, bias, y5);
}

}  // namespace

bool implicit_unembed_sm90(const Problem& p, bool tokens, const at::Tensor& x, const at::Tensor& wt,
                           const std::optional<at::Tensor>& bias, const at::Tensor& y5) {
#ifdef PATCHGEMM_SM90A
  return y5.scalar_type() == at::kHalf ? launch_for_layout<__half>(tokens, p, x, wt, bias, y5)
                                       : launch_for_layout<__nv_bfloat16>(tokens, p, x, wt, bias, y5);
#else
  return false;
#endif
}

}  // namespace cuda
}  // namespace patchgemm
#endif  // USE_ROCM
