// Implicit-GEMM weight gradient of the patch embedding on Hopper (sm_90a), patch rows in runs of 8
// or 4 elements (kw % 8 == 0: ViT's 16; kw % 4 == 0: P5's and U1's kw = 4) or in pairs (kw = 2: P4):
//   dW^T [K, E] = P^T [K, B*N] @ grad_y [B*N, E]
// with P read straight from x inside the main loop, as implicit_patch_weight_grad.cu (which explains
// the token ranges and partial sums) does on mma.sync.
//
// A block: 128 patch columns x kTileN (128 or 192) embeddings over a range of tokens (the
// reduction), two warpgroups of 64 columns each, over wgmma_main_loop's pipeline of 64-token
// slices, every operand a 128B-swizzled tile read by descriptor:
//   - patches (A = P^T): a token's 64 columns of a warpgroup are one 128-byte row, copied as 8- or
//     4-element runs of x: an M-major tile, [token][column].
//   - patches, kw = 2: pair-major words [pair][token] as implicit_patch_weight_grad.cu copies them
//     (one 16-byte copy per pair of 4 tokens; 4-byte runs into an M-major tile are slower). No
//     descriptor describes that, so A goes through registers, each a byte permute of one 64-bit
//     load, and the accumulator rows g and g + 8 of a warp are a pair's two columns.
//   - grad_y channels-first [B, E, N] (B): rows are embeddings, 64 tokens each, K-major; one TMA
//     copy (tma.cuh) per slice where N % 64 == 0 (a slice's tokens then share a sample), else
//     cp.async pieces of 8 or 4 tokens of one sample (N % 8 or N % 4 == 0).
//   - grad_y tokens [B*N, E] (B): rows are tokens, each 64 embeddings of one 8 KB block: N-major;
//     one TMA copy (tma.cuh) per block, issued by one thread. Tokens past the range read whatever
//     grad_y holds there: their patches (A) are zeros.
// The result leaves through shared memory as rows of dW [E, K]: the output dtype where one block
// covers all tokens, fp32 partial sums otherwise. The bias gradient, where asked for, is summed from
// the grad_y tiles in shared memory, each slice by one of the column tiles' blocks (which all read
// it), into fp32 partial sums per block; sum_token_ranges.cu adds the partial sums.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"
#include "kernels/primitives/tma.cuh"
#include "kernels/primitives/wgmma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileM = 128;  // patch columns per block, 64 per warpgroup
constexpr int kTileK = 64;   // tokens per slice
constexpr int kStages = 5;
static_assert(kTileM == kWeightGradColumns && kTileK == kWeightGradTokens, "implicit_weight_grad's split");
constexpr int kStagePitch = kTileM + 4;  // floats of an output stage row: conflict-free, 16-byte rows
constexpr int kPairPitch = kTileK + 8;   // words of a pair-major row: = 8 mod 32, conflict-free 64-bit loads

// A token's place, (sample, patch-grid depth, row, column), moved along by mixed-radix addition:
// the main loop steps tokens without divisions.
struct TokenCursor {
  unsigned b, d, h, w;

  __device__ __forceinline__ TokenCursor(const Problem& p, unsigned token) {
    b = token / p.tokens;
    const unsigned n = token - b * p.tokens;
    w = n % p.gw, h = n / p.gw % p.gh, d = n / p.gw / p.gh;
  }

  // Moves by the tokens `step` holds (its depth digit taken mod gd, the grid's depth).
  __device__ __forceinline__ void advance(const Problem& p, const TokenCursor& step, unsigned gd) {
    w += step.w;
    unsigned carry = w >= unsigned(p.gw);
    w -= carry ? p.gw : 0;
    h += step.h + carry;
    carry = h >= unsigned(p.gh);
    h -= carry ? p.gh : 0;
    d += step.d + carry;
    carry = d >= gd;
    d -= carry ? gd : 0;
    b += step.b + carry;
  }

  __device__ __forceinline__ unsigned n(const Problem& p) const { return (d * p.gh + h) * p.gw + w; }

  // patch_origin: the offset in x of the token's patch.
  __device__ __forceinline__ int64_t origin(const Problem& p) const {
    return b * p.stride[0] + int64_t{d} * p.kd * p.stride[2] + int64_t{h} * p.kh * p.stride[3] + int64_t{w} * p.kw;
  }
};

template <int kTileN, bool kPairs>
struct Slot {
  static constexpr int kA = kPairs ? kTileM / 2 * kPairPitch * 4 : kTileM * 128, kB = kTileN * 128;
  static constexpr int kBytes = kA + kB;
  static_assert(kA % 1024 == 0 && kB % 1024 == 0);  // the swizzle's alignment
};

// kDyPiece: tokens per copy of channels-first grad_y (64: a slice's by TMA; 8 or 4 by cp.async); 0:
// grad_y is tokens (by TMA). kRun: elements per copy of x (8 or 4; 2: pairs). db_partial: the bias
// gradient's partial sums [splits * tiles_m, E], or null.
template <typename T, int kTileN, int kDyPiece, int kRun>
__global__ void __launch_bounds__(kThreads, 1)
    implicit_weight_grad_kernel_sm90(Problem p, const T* __restrict__ x, const T* __restrict__ dy,
                                     const __grid_constant__ CUtensorMap dy_map, int64_t chunk, bool partial,
                                     void* __restrict__ out, float* __restrict__ db_partial) {
#ifdef PATCHGEMM_HAS_WGMMA
  constexpr bool kPairs = kRun == 2;
  using S = Slot<kTileN, kPairs>;
  constexpr bool kTokensDy = kDyPiece == 0, kDyByTma = kDyPiece == 0 || kDyPiece == kTileK;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;  // the launch adds the slack
  unsigned char* smem = smem_raw + (base - raw);
  const SlotBarriers<kStages> dy_landed{base + kStages * S::kBytes};  // grad_y's TMA copies
  if constexpr (kDyByTma) {
    dy_landed.init();
    if (threadIdx.x == 0) prefetch_tensor_map(dy_map);
    __syncthreads();
  }

  const int tiles_n = (p.E + kTileN - 1) / kTileN, tiles_m = (p.K + kTileM - 1) / kTileM;
  const int e0 = static_cast<int>(blockIdx.x % tiles_n) * kTileN;
  const int tile_m = static_cast<int>(blockIdx.x / tiles_n % tiles_m), col0 = tile_m * kTileM;
  const int64_t split = blockIdx.x / tiles_n / tiles_m;
  // Token indices fit in 32 bits (checked on the host).
  const int t_begin = static_cast<int>(split * chunk), t_end = static_cast<int>(min(split * chunk + chunk, p.rows));
  const int k_tiles = (t_end - t_begin + kTileK - 1) / kTileK;

  // A: this thread copies runs a_run + kRunStep i of token a_token of each slice. Runs of 4: a warp
  // is 32 tokens of one run. Runs of 8: lanes pair up on runs 2r and 2r + 1 of a token (for kw %
  // 16 == 0, 32 contiguous bytes), a warp is 16 tokens. Tokens past the range and columns past K
  // read zeros (without loads).
  constexpr int kPair = kRun == 8 ? 2 : 1;
  constexpr int kRunsA = kTileM / kRun * kTileK / kThreads;  // A copies per thread and slice
  constexpr int kRunStep = kThreads / kTileK;                // between one thread's runs
  // Pairs: this thread copies pairs a_pair + 16 i of tokens a_token .. a_token + 3 (the range's
  // ends are multiples of 4 tokens: grid rows are, checked on the host).
  constexpr int kPairCopies = kTileM / 2 * kTileK / 4 / kThreads;
  const int a_pair = threadIdx.x / 16;
  const int a_token = kPairs ? threadIdx.x % 16 * 4 : threadIdx.x / kPair % kTileK;
  const int a_run = threadIdx.x / (kPair * kTileK) * kPair + threadIdx.x % kPair;
  // Run i's column is (a_run + kRunStep i) kRun, in warpgroup column / 64's tile. Its swizzled
  // destination is run 0's with a compile-time XOR and step: a_run kRun < kRunStep kRun, which
  // divides 64, so the terms never carry (as a table the compiler recomputed it every slice).
  static_assert(64 % (kRunStep * kRun) == 0 && kRunStep * kRun * 2 <= 128);
  const uint32_t a_dst0 = swizzle_128b(a_token, a_run * kRun * 2);
  auto run_dst = [&](int i) {
    return (a_dst0 ^ (2 * kRunStep * kRun * i % 128)) + kRunStep * kRun * i / 64 * 8192;
  };
  constexpr int kCopiesA = kPairs ? kPairCopies : kRunsA;
  int run_offset[kCopiesA];  // 0 past K, where run_valid's bit i is clear
  unsigned run_valid = 0;
#pragma unroll
  for (int i = 0; i < kCopiesA; ++i) {
    const int column = kPairs ? col0 + 2 * (a_pair + 16 * i) : col0 + (a_run + kRunStep * i) * kRun;
    run_offset[i] = column < p.K ? patch_offset(p, column) : 0;
    run_valid |= unsigned{column < p.K} << i;
  }

  // B, channels-first by cp.async: piece b_piece of embedding rows b_row + kRowStep i.
  constexpr int kPiecesK = kDyByTma ? 1 : kTileK / kDyPiece;  // pieces per embedding row
  constexpr int kRowStep = kThreads / kPiecesK;
  constexpr int kCopiesB = kDyByTma ? 0 : kTileN / kRowStep;
  static_assert(kDyByTma || kCopiesB * kThreads * kDyPiece == kTileN * kTileK);
  const int b_piece = threadIdx.x % kPiecesK, b_row = threadIdx.x / kPiecesK;
  int64_t b_offset[kCopiesB > 0 ? kCopiesB : 1];  // row offsets
  uint32_t b_dst[kCopiesB > 0 ? kCopiesB : 1];
  bool b_valid[kCopiesB > 0 ? kCopiesB : 1];
#pragma unroll
  for (int i = 0; i < kCopiesB; ++i) {
    const int row = b_row + kRowStep * i;
    b_valid[i] = e0 + row < p.E;
    b_offset[i] = int64_t{b_valid[i] ? e0 + row : 0} * p.tokens;
    b_dst[i] = swizzle_128b(row, b_piece * kDyPiece * 2);
  }

  // The slices' tokens: this thread's A token and channels-first B piece, stepped kTileK at a time
  // (load_slice runs for slices 0, 1, 2, ... in order).
  const unsigned gd = p.tokens / (p.gh * p.gw);
  const TokenCursor step(p, kTileK);
  TokenCursor a_at(p, t_begin + a_token), b_at(p, t_begin + b_piece * (kDyByTma ? 0 : kDyPiece));

  auto load_slice = [&](int kt, int slot) {
    const uint32_t slot_base = base + slot * S::kBytes;
    const int t0 = t_begin + kt * kTileK;
    {
      const bool valid = t0 + a_token < t_end;
      const T* origin = x + (valid ? a_at.origin(p) : 0);
#pragma unroll
      for (int i = 0; i < kCopiesA; ++i) {
        if constexpr (kPairs) {
          cp_async<16>(slot_base + ((a_pair + 16 * i) * kPairPitch + a_token) * 4, origin + run_offset[i],
                       valid && (run_valid >> i & 1));
        } else {
          cp_async<kRun * 2>(slot_base + run_dst(i), origin + run_offset[i], valid && (run_valid >> i & 1));
        }
      }
      a_at.advance(p, step, gd);
    }
    if constexpr (kTokensDy) {
      if (threadIdx.x == 0) {
        const uint32_t bar = dy_landed.arm(slot, S::kB);
#pragma unroll
        for (int h = 0; h < kTileN / 64; ++h) tma_load(slot_base + S::kA + h * 8192, dy_map, bar, e0 + 64 * h, t0);
      }
    } else if constexpr (kDyByTma) {  // the slice's 64 tokens, of one sample
      if (threadIdx.x == 0) {
        const int b = t0 / p.tokens;
        tma_load(slot_base + S::kA, dy_map, dy_landed.arm(slot, S::kB), t0 - b * p.tokens, e0, b);
      }
    } else {  // a piece's tokens share a sample: N % kDyPiece == 0
      const bool valid = t0 + b_piece * kDyPiece < t_end;
      const T* src = dy + (valid ? int64_t{b_at.b} * p.E * p.tokens + b_at.n(p) : 0);
#pragma unroll
      for (int i = 0; i < kCopiesB; ++i) {
        cp_async<kDyPiece * 2>(slot_base + S::kA + b_dst[i], src + b_offset[i], valid && b_valid[i]);
      }
      b_at.advance(p, step, gd);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, wq = warp % 4;
  float acc[kTileN / 2];
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;

  auto landed = [&](int kt) {
    if constexpr (kDyByTma) dy_landed.wait(kt);
  };
  const int g = lane / 4, q = lane % 4;
  // Pairs: this lane's A words, pair wg*32 + wq*8 + g (the warp's rows g and g + 8), tokens 2q ...
  const unsigned char* a_words = smem + ((wg * 32 + wq * 8 + g) * kPairPitch + 2 * q) * 4;
  // The bias gradient: slices s with s % tiles_m == tile_m (global slice indices), summed by
  // threads of whole embeddings: channels-first, thread e one 128-byte row (its chunks in a rotated
  // order: conflict-free); tokens, thread e / 2 two columns of the 64-embedding boxes. All of a
  // slice's grad_y counts: ranges are whole slices, and past the last token the copies read zeros.
  float bias_sum[2] = {0.f, 0.f};
  const bool bias_thread = db_partial != nullptr && static_cast<int>(threadIdx.x) < (kTokensDy ? kTileN / 2 : kTileN);
  int bias_slice = t_begin / kTileK % tiles_m;  // slice kt's index mod tiles_m (t_begin % kTileK == 0)
  auto add_bias = [&](int slot) {
    const unsigned char* tile = smem + slot * S::kBytes + S::kA;
    if constexpr (kTokensDy) {
      const unsigned char* box = tile + threadIdx.x / 32 * 8192;
#pragma unroll 8
      for (int r = 0; r < kTileK; ++r) {
        const T* e = reinterpret_cast<const T*>(box + swizzle_128b(r, threadIdx.x % 32 * 4));
        bias_sum[0] += to_float(e[0]), bias_sum[1] += to_float(e[1]);
      }
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const uint4 v = *reinterpret_cast<const uint4*>(tile + threadIdx.x * 128 + (c + threadIdx.x) % 8 * 16);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) bias_sum[0] += to_float(e[i]);
      }
    }
  };
  wgmma_main_loop<kStages, kPairs>(k_tiles, load_slice, landed, [&](int slot) {
    fence_accumulators(acc);
    const uint32_t slot_base = base + slot * S::kBytes;
    uint32_t af[kTileK / 16][4];
    if constexpr (kPairs) {
#pragma unroll
      for (int t = 0; t < kTileK / 16; ++t) {
        const unsigned char* a = a_words + slot * S::kBytes + 16 * t * 4;
        const uint2 lo = *reinterpret_cast<const uint2*>(a), hi = *reinterpret_cast<const uint2*>(a + 8 * 4);
        af[t][0] = __byte_perm(lo.x, lo.y, 0x5410);  // row g: column 2p of tokens 2q, 2q + 1
        af[t][1] = __byte_perm(lo.x, lo.y, 0x7632);  // row g + 8: column 2p + 1
        af[t][2] = __byte_perm(hi.x, hi.y, 0x5410);  // tokens 2q + 8, 2q + 9
        af[t][3] = __byte_perm(hi.x, hi.y, 0x7632);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kTileK / 16; ++t) {  // 16 tokens: 16 rows of the M-major (N-major) tiles
      const uint64_t desc_b = kTokensDy ? smem_descriptor_128b(slot_base + S::kA + 2048 * t, 8192)
                                        : smem_descriptor_128b(slot_base + S::kA + 32 * t);
      if constexpr (kPairs) {
        wgmma_rs<T, kTileN, kTokensDy>(acc, af[t], desc_b);
      } else {
        wgmma_ss<T, kTileN, true, kTokensDy>(acc, smem_descriptor_128b(slot_base + wg * 8192 + 2048 * t), desc_b);
      }
    }
    wgmma_commit();
    fence_accumulators(acc);
    if (bias_thread && bias_slice == tile_m) add_bias(slot);  // while the tensor cores run
    if (++bias_slice == tiles_m) bias_slice = 0;
  });
  fence_accumulators(acc);  // the pipeline's shared memory becomes the output stage
  if (bias_thread) {
    float* db = db_partial + (split * tiles_m + tile_m) * p.E;
#pragma unroll
    for (int i = 0; i < (kTokensDy ? 2 : 1); ++i) {
      const int e = e0 + (kTokensDy ? 2 * static_cast<int>(threadIdx.x) + i : static_cast<int>(threadIdx.x));
      if (e < p.E) db[e] = bias_sum[i];
    }
  }

  // acc[4 j + 2 half + i]: column wg*64 + wq*16 + g + 8 half (pairs: + 2 g + half), embedding 8 j +
  // 2 q + i. Staged as [embedding][column] fp32, then written as rows of dW [E, K] (4 columns per
  // store: K % 4 == 0).
  float* stage = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int column = wg * 64 + wq * 16 + (kPairs ? 2 * g + half : g + 8 * half);
#pragma unroll
      for (int i = 0; i < 2; ++i) stage[(8 * j + 2 * q + i) * kStagePitch + column] = acc[4 * j + 2 * half + i];
    }
  }
  __syncthreads();
  const int64_t out_offset = partial ? split * p.E * p.K : 0;
  for (int u = threadIdx.x; u < kTileN * kTileM / 4; u += kThreads) {
    const int n = u / (kTileM / 4), m = u % (kTileM / 4) * 4;
    if (e0 + n >= p.E || col0 + m >= p.K) continue;
    const float4 v = *reinterpret_cast<const float4*>(stage + n * kStagePitch + m);
    const int64_t at = out_offset + int64_t{e0 + n} * p.K + col0 + m;
    if (partial) {
      *reinterpret_cast<float4*>(static_cast<float*>(out) + at) = v;
    } else {
      *reinterpret_cast<uint2*>(static_cast<T*>(out) + at) = {pack2<T>(v.x, v.y), pack2<T>(v.z, v.w)};
    }
  }
#endif
}

template <typename T, int kTileN, int kDyPiece, int kRun>
bool launch(const Problem& p, const at::Tensor& x5, const at::Tensor& dy, int64_t splits, int64_t chunk,
            const at::Tensor& out, const at::Tensor& db_partial) {
  using S = Slot<kTileN, kRun == 2>;
  constexpr int smem = 1024 + kStages * S::kBytes + kStages * 8;
  static_assert(kTileN * kStagePitch * 4 <= kStages * S::kBytes);
  if (smem > at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) return false;
  // grad_y's tensor map: tokens [rows, E] in 64 x 64 boxes; channels-first [B, E, N] in boxes of
  // kTileN embeddings x 64 tokens.
  CUtensorMap dy_map{};
  const uint64_t E = p.E, N = p.tokens, rows = p.rows;
  if constexpr (kDyPiece == 0) {
    const uint64_t dims[2] = {E, rows}, strides[1] = {E * 2};
    const uint32_t box[2] = {64, kTileK};
    if (!encode_tensor_map(dy_map, dy.const_data_ptr(), 2, dims, strides, box)) return false;
  } else if constexpr (kDyPiece == kTileK) {
    const uint64_t dims[3] = {N, E, rows / N}, strides[2] = {N * 2, E * N * 2};
    const uint32_t box[3] = {kTileK, kTileN, 1};
    if (!encode_tensor_map(dy_map, dy.const_data_ptr(), 3, dims, strides, box)) return false;
  }
  auto kernel = implicit_weight_grad_kernel_sm90<T, kTileN, kDyPiece, kRun>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  const int64_t blocks = splits * ((p.K + kTileM - 1) / kTileM) * ((p.E + kTileN - 1) / kTileN);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(dy.const_data_ptr()), dy_map, chunk,
      out.scalar_type() == at::kFloat, out.data_ptr(), db_partial.defined() ? db_partial.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, int kTileN, int kRun>
bool launch_for_layout(int dy_piece, const Problem& p, const at::Tensor& x5, const at::Tensor& dy, int64_t splits,
                       int64_t chunk, const at::Tensor& out, const at::Tensor& db_partial) {
  switch (dy_piece) {
    case 8:  // a slice's 64 tokens of one sample by TMA where N allows, else pieces of 8
      return p.tokens % kTileK == 0 && chunk % kTileK == 0
                 ? launch<T, kTileN, kTileK, kRun>(p, x5, dy, splits, chunk, out, db_partial)
                 : launch<T, kTileN, 8, kRun>(p, x5, dy, splits, chunk, out, db_partial);
    case 4: return launch<T, kTileN, 4, kRun>(p, x5, dy, splits, chunk, out, db_partial);
    default: return launch<T, kTileN, 0, kRun>(p, x5, dy, splits, chunk, out, db_partial);
  }
}

template <typename T, int kTileN>
bool launch_for_run(int run, int dy_piece, const Problem& p, const at::Tensor& x5, const at::Tensor& dy,
                    int64_t splits, int64_t chunk, const at::Tensor& out, const at::Tensor& db_partial) {
  switch (run) {
    case 8: return launch_for_layout<T, kTileN, 8>(dy_piece, p, x5, dy, splits, chunk, out, db_partial);
    case 4: return launch_for_layout<T, kTileN, 4>(dy_piece, p, x5, dy, splits, chunk, out, db_partial);
    default: return launch_for_layout<T, kTileN, 2>(dy_piece, p, x5, dy, splits, chunk, out, db_partial);
  }
}

}  // namespace

bool implicit_weight_grad_sm90(const Problem& p, int run, int dy_piece, const at::Tensor& x5, const at::Tensor& dy,
                               int64_t splits, int64_t chunk, const at::Tensor& out, const at::Tensor& db_partial) {
#ifdef PATCHGEMM_SM90A
  const bool wide = p.E % 192 == 0;
  if (x5.scalar_type() == at::kHalf) {
    return wide ? launch_for_run<__half, 192>(run, dy_piece, p, x5, dy, splits, chunk, out, db_partial)
                : launch_for_run<__half, 128>(run, dy_piece, p, x5, dy, splits, chunk, out, db_partial);
  }
  return wide ? launch_for_run<__nv_bfloat16, 192>(run, dy_piece, p, x5, dy, splits, chunk, out, db_partial)
              : launch_for_run<__nv_bfloat16, 128>(run, dy_piece, p, x5, dy, splits, chunk, out, db_partial);
#else
  return false;
#endif
}

}  // namespace cuda
}  // namespace patchgemm
