// Implicit-GEMM patch unembedding, 16-bit dtypes, kw = 2 (on Hopper kw = 4 too:
// implicit_patch_unembed_sm90.cu): y = unpatchify(x_tokens @ W) (+ bias),
// the ConvTranspose with kernel == stride, and so also patch_embed's input gradient. The GEMM's
// output tile is scattered into y from its epilogue: no patch matrix Q is written to and re-read
// from global memory. (The GEMM -> scatter path moves 4 extra bytes per element of y.)
//
// The GEMM is (B*N tokens) x (K = C_out*kd*kh*kw patch columns) x C_in. A block computes 128 tokens
// x 128 columns with 8 warps (2 x 4) of mma.sync m16n8k16, fp32 accumulation, over a 3-stage
// cp.async pipeline of 64-channel slices, as the forward (implicit_patch_gemm.cu). Operand A = x:
// tokens [B*N, C_in] is K-major in shared memory (ldmatrix), channels-first [B, C_in, N] is
// [channel][token] (ldmatrix.trans). Operand B = W^T [K, C_in], transposed once on the host.
// The epilogue: with kw = 2 an accumulator pair (columns 2p, 2p + 1 of one token) is one 32-bit
// word of y, and the words of 4 consecutive tokens of pair p are 16 contiguous bytes of y. So the
// tile is staged pair-major, words [pair][token], and leaves in 16-byte stores, each pair's tokens
// of a patch-grid row one contiguous run.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileM = 128;                       // tokens per block
constexpr int kTileN = 128, kPairs = kTileN / 2;  // patch columns (pairs) per block
constexpr int kTileK = 64;                        // input channels per pipeline stage
constexpr int kStages = 3;
constexpr int kPitch = kTileK + 8;       // elements of a [token][channel] or [column][channel] row (144 B)
constexpr int kTokenPitch = kTileM + 8;  // elements of a [channel][token] row (272 B: conflict-free ldmatrix)
constexpr int kStagePitch = kTileM + 8;  // words of the output stage's [pair][token] rows (= 8 mod 32)

__host__ __device__ constexpr int slot_bytes_a(bool tokens_in) {
  return tokens_in ? kTileM * kPitch * 2 : kTileK * kTokenPitch * 2;
}
constexpr int kSlotB = kTileN * kPitch * 2;
constexpr int smem_bytes(bool tokens_in) {
  return std::max(kStages * (slot_bytes_a(tokens_in) + kSlotB), kPairs * kStagePitch * 4);
}

// p describes y (the volume the patches tile) with p.E = C_in, the reduction, and p.ldw the row
// length of wt = W^T [K, ldw] (C_in rounded up to 8, zero columns).
template <typename T, bool kTokensIn>
__global__ void __launch_bounds__(kThreads, 2) implicit_unembed_kernel(Problem p, const T* __restrict__ x,
                                                                    const T* __restrict__ wt,
                                                                    const T* __restrict__ bias, T* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
  constexpr int kSlotA = slot_bytes_a(kTokensIn);
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sA = smem_address(smem), sB = sA + kStages * kSlotA;

  const int tiles_n = (p.K + kTileN - 1) / kTileN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x / tiles_n) * kTileM;
  const int pair0 = static_cast<int>(blockIdx.x % tiles_n) * kPairs;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_tiles = (p.ldw + kTileK - 1) / kTileK;

  // A. Tokens in: 16-byte pieces (8 channels) at channel a_col of token rows a_row + 32 i.
  // Channels-first: pieces of 8 tokens (a sample's: tokens % 8 == 0) at a_col of channel rows
  // a_row + 16 i. Tokens past the end read the last real ones (never stored); channels past C_in
  // read zeros (the reduction).
  const int a_col = kTokensIn ? threadIdx.x % 8 * 8 : threadIdx.x % 16 * 8;
  const int a_row = kTokensIn ? threadIdx.x / 8 : threadIdx.x / 16;
  const T* a_src[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kTokensIn) {
      a_src[i] = x + min(m0 + a_row + 32 * i, p.rows - 1) * p.E + a_col;
    } else {
      const int64_t token = min(m0 + a_col, p.rows - 8), b = token / p.tokens;
      a_src[i] = x + (b * p.E + min(a_row + 16 * i, p.E - 1)) * p.tokens + (token - b * p.tokens);
    }
  }
  const uint32_t a_dst = sA + (kTokensIn ? a_row * kPitch + a_col : a_row * kTokenPitch + a_col) * 2;
  // B: pieces at channel b_col of columns b_row + 32 i. Columns past K read zeros (without loads:
  // clamped rows would all hit one line of W^T).
  const int b_col = threadIdx.x % 8 * 8, b_row = threadIdx.x / 8;
  const T* b_src[4];
  bool b_valid[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    b_valid[i] = 2 * pair0 + b_row + 32 * i < p.K;
    b_src[i] = wt + int64_t{min(2 * pair0 + b_row + 32 * i, p.K - 1)} * p.ldw + b_col;
  }
  const uint32_t b_dst = sB + (b_row * kPitch + b_col) * 2;

  auto load_slice = [&](int kt, int slot) {
    const int e0 = kt * kTileK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kTokensIn) {
        const bool valid = e0 + a_col < p.E;  // C_in % 8 == 0
        cp_async<16>(a_dst + slot * kSlotA + 32 * i * kPitch * 2, a_src[i] + (valid ? e0 : 0), valid);
      } else {
        const bool valid = e0 + a_row + 16 * i < p.E;
        cp_async<16>(a_dst + slot * kSlotA + 16 * i * kTokenPitch * 2, a_src[i] + (valid ? int64_t{e0} * p.tokens : 0),
                     valid);
      }
    }
    const bool in_w = e0 + b_col < p.ldw;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cp_async<16>(b_dst + slot * kSlotB + 32 * i * kPitch * 2, b_src[i] + (in_w ? e0 : 0), in_w && b_valid[i]);
    }
  };

  const int wm = warp / 4, wn = warp % 4;  // a warp: 64 tokens x 32 columns
  const uint32_t a_frag = kTokensIn ? sA + ((wm * 64 + lane % 16) * kPitch + lane / 16 * 8) * 2
                                    : sA + ((lane / 16 * 8 + lane % 8) * kTokenPitch + wm * 64 + lane / 8 % 2 * 8) * 2;
  const uint32_t b_frag = sB + ((wn * 32 + lane / 16 * 8 + lane % 8) * kPitch + lane / 8 % 2 * 8) * 2;
  uint32_t af[2][4][4], bf[2][4][2];
  auto load_fragments = [&](int buf, int slot, int kk) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      if constexpr (kTokensIn) {
        ldmatrix_x4(af[buf][mi], a_frag + slot * kSlotA + (mi * 16 * kPitch + kk) * 2);
      } else {
        ldmatrix_x4_trans(af[buf][mi], a_frag + slot * kSlotA + (kk * kTokenPitch + mi * 16) * 2);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, b_frag + slot * kSlotB + (j * 8 * kPitch + kk) * 2);
      bf[buf][j][0] = r[0], bf[buf][j][1] = r[1], bf[buf][j + 1][0] = r[2], bf[buf][j + 1][1] = r[3];
    }
  };

  float acc[4][4][4] = {};
  pipelined_main_loop<kStages, kTileK>(k_tiles, load_slice, load_fragments, [&](int buf) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_16816<T>(acc[mi][j], af[buf][mi], bf[buf][j]);
    }
  });
  __syncthreads();  // the pipeline's shared memory becomes the output stage

  // acc[mi][j]: tokens g and g + 8 of m-tile mi, columns 2q and 2q + 1 of n-tile j: one word of
  // pair wn * 16 + j * 4 + q. The bias is per output channel: pair / (kd * kh).
  uint32_t* stage = reinterpret_cast<uint32_t*>(smem);
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int pair = wn * 16 + j * 4 + q;
    const float b = bias ? to_float(bias[min(pair0 + pair, p.K / 2 - 1) / (p.kd * p.kh)]) : 0.f;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        stage[pair * kStagePitch + wm * 64 + mi * 16 + g + half * 8] =
            pack2<T>(acc[mi][j][2 * half] + b, acc[mi][j][2 * half + 1] + b);
      }
    }
  }
  __syncthreads();
  // 16-byte stores: this thread's 4 tokens 4 group .. (one patch-grid row: gw % 4 == 0) of pairs
  // first_pair + 8 i.
  const int group = threadIdx.x % 32, first_pair = threadIdx.x / 32;
  const int64_t token = m0 + 4 * group;
  if (token >= p.rows) return;
  T* origin = y + patch_origin(p, token);
#pragma unroll
  for (int i = 0; i < kPairs / 8; ++i) {
    const int pair = first_pair + 8 * i;
    if (2 * (pair0 + pair) >= p.K) break;
    *reinterpret_cast<uint4*>(origin + patch_offset(p, 2 * (pair0 + pair))) =
        *reinterpret_cast<const uint4*>(stage + pair * kStagePitch + 4 * group);
  }
#endif
}

template <typename T, bool kTokensIn>
void launch(const Problem& p, const at::Tensor& x, const at::Tensor& wt, const std::optional<at::Tensor>& bias,
            const at::Tensor& y5) {
  constexpr int smem = smem_bytes(kTokensIn);
  auto kernel = implicit_unembed_kernel<T, kTokensIn>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  const int64_t blocks = (p.rows + kTileM - 1) / kTileM * ((p.K + kTileN - 1) / kTileN);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const T*>(x.const_data_ptr()), static_cast<const T*>(wt.const_data_ptr()),
      bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr, static_cast<T*>(y5.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_for_layout(bool tokens, const Problem& p, const at::Tensor& x, const at::Tensor& wt,
                       const std::optional<at::Tensor>& bias, const at::Tensor& y5) {
  tokens ? launch<T, true>(p, x, wt, bias, y5) : launch<T, false>(p, x, wt, bias, y5);
}

}  // namespace

void implicit_unembed_mma(const Problem& p, bool tokens, const at::Tensor& x, const at::Tensor& w2,
                          const std::optional<at::Tensor>& bias, const at::Tensor& y5) {
  const int64_t C_in = w2.size(0), K = w2.size(1);
  // W^T [K, C_in] with rows padded to 16 bytes (zero columns).
  const at::Tensor wt = at::empty({K, (C_in + 7) / 8 * 8}, w2.options());
  TORCH_INTERNAL_ASSERT(pad_weight(w2.t(), std::nullopt, wt));
  Problem q = p;
  q.ldw = static_cast<int>(wt.size(1));
  if (x.scalar_type() == at::kHalf) {
    launch_for_layout<__half>(tokens, q, x, wt, bias, y5);
  } else {
    launch_for_layout<__nv_bfloat16>(tokens, q, x, wt, bias, y5);
  }
}

}  // namespace cuda
}  // namespace patchgemm
