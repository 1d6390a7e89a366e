// Fused patch embedding for patches of at most 64 elements (tiny K, e.g. P3's Conv3d(4, E, 2)):
// y[b, :, tokens] = W [E, K] @ patches^T (+ bias), channels-first, 16-bit dtypes.
//
// There the GEMM is so thin that gather -> GEMM is pure data movement, and writing y dominates
// (E outputs per K inputs). One kernel reads x once through its strides and writes y once: a block
// gathers a tile of 128 tokens' patches into shared memory, then each warp multiplies a 16-row
// block of W (kept in registers) against 64 of those tokens with mma.sync (fp32 accumulation),
// converts in registers, and stages its 16 x 64 outputs in its own shared-memory slice so the
// stores to y are whole 128-byte rows of 16-byte vectors. The instruction count per output stays
// near one (a first version with WMMA and fp32 staging was issue-bound at twice the time of the
// unfused path). fp32 takes the same structure on FMA units (tensor cores would mean TF32): the tile
// gathered as P^T [K][token], each warp 8 embeddings x 128 tokens, 4 tokens a lane, so P^T and y
// move in float4s and W^T's 8 values per k are two broadcast float4s.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kTileTokens = 128;  // tokens per block tile
constexpr int kWarpTokens = 64;   // tokens per warp unit (8 MMA n-tiles)
constexpr int kMaxPatch = 64;     // K, padded to a multiple of 16
constexpr int kStagePitch = kWarpTokens / 2 + 4;  // words per staged row: conflict-free stores

// The volume [B, C, D, H, W] (any strides) cut into kd x kh x kw patches; tokens row-major.
struct Volume {
  int64_t stride[5];
  int kd, kh, kw, K, Kp;  // K = C * kd * kh * kw; Kp = K rounded up to 16
  int gh, gw;             // patch grid (the depth count follows from tokens)
  int tokens;             // N per sample (< 2^31)
  int64_t batch;
  int unit;               // elements per load: 2 (pairs along w) or 1
};

// Offset in x of the first element of sample b's token n's patch.
__device__ __forceinline__ int64_t patch_start(const Volume& v, int64_t b, int n) {
  const int nw = n % v.gw, nh = n / v.gw % v.gh, nd = n / v.gw / v.gh;
  return b * v.stride[0] + int64_t{nd} * v.kd * v.stride[2] + int64_t{nh} * v.kh * v.stride[3] +
         int64_t{nw} * v.kw * v.stride[4];
}

// k_off[k]: the offset of patch element k = (c, i, j, l) from the patch's first element, for every
// k < K (the block's threads share the work; a barrier must follow).
__device__ __forceinline__ void fill_element_offsets(int64_t* k_off, const Volume& v) {
  for (int k = threadIdx.x; k < v.K; k += blockDim.x) {
    const int l = k % v.kw, j = k / v.kw % v.kh, i = k / (v.kw * v.kh) % v.kd, c = k / (v.kw * v.kh * v.kd);
    k_off[k] = c * v.stride[1] + i * v.stride[2] + j * v.stride[3] + l * v.stride[4];
  }
}

// P[t, 0..Kp) for the tile's tokens (row pitch ldp): thread t % 128 owns token t and walks the
// patch in units (pairs along w where the layout allows), so a warp reads runs along w.
template <typename T>
__device__ __forceinline__ void gather_patches(T* P, int ldp, const T* __restrict__ x, const int64_t* k_off,
                                               const Volume& v, int64_t b, int t0, int count) {
  const int t = threadIdx.x % kTileTokens, first = threadIdx.x / kTileTokens;
  constexpr int kLanesPerToken = kThreads / kTileTokens;
  T* row = P + t * ldp;
  const int units = v.K / v.unit;
  if (t >= count) {
    for (int u = first; u < v.Kp / v.unit; u += kLanesPerToken) {
      for (int e = 0; e < v.unit; ++e) row[u * v.unit + e] = zero<T>();
    }
    return;
  }
  const T* origin = x + patch_start(v, b, t0 + t);
  if (v.unit == 2) {
    constexpr int kBatch = 8;
    for (int u0 = first; u0 < units; u0 += kLanesPerToken * kBatch) {
      uint32_t val[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int u = u0 + q * kLanesPerToken;
        if (u < units) val[q] = *reinterpret_cast<const uint32_t*>(origin + k_off[u * 2]);
      }
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int u = u0 + q * kLanesPerToken;
        if (u < units) *reinterpret_cast<uint32_t*>(row + u * 2) = val[q];
      }
    }
  } else {
    for (int k = first; k < v.K; k += kLanesPerToken) row[k] = origin[k_off[k]];
  }
  for (int k = v.K + first; k < v.Kp; k += kLanesPerToken) row[k] = zero<T>();
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tiny_embed_kernel(Volume v, const T* __restrict__ x,
                                                              const T* __restrict__ w, int E,
                                                              const T* __restrict__ bias, T* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem[];
  const int ldw = v.Kp + 8, ldp = v.Kp + 8;  // odd multiples of 16 bytes: conflict-free ldmatrix
  T* Ws = reinterpret_cast<T*>(smem);
  T* Ps = Ws + E * ldw;
  uint32_t* stage = reinterpret_cast<uint32_t*>(Ps + kTileTokens * ldp);  // per warp 16 x kStagePitch
  int64_t* k_off = reinterpret_cast<int64_t*>(stage + kWarps * 16 * kStagePitch);

  // W [E, K] into shared memory with zero columns K..Kp (whole 16-wide MMA steps).
  for (int i = threadIdx.x; i < E * v.Kp; i += kThreads) {
    const int e = i / v.Kp, k = i % v.Kp;
    Ws[e * ldw + k] = k < v.K ? w[e * v.K + k] : zero<T>();
  }
  fill_element_offsets(k_off, v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  uint32_t* my_stage = stage + warp * 16 * kStagePitch;
  const int64_t per_sample = (v.tokens + kTileTokens - 1) / kTileTokens, tiles = v.batch * per_sample;
  const int units = E / 16 * (kTileTokens / kWarpTokens), ksteps = v.Kp / 16;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / per_sample;
    const int t0 = static_cast<int>(tile % per_sample) * kTileTokens;
    const int count = min(kTileTokens, v.tokens - t0);
    __syncthreads();  // W and k_off ready; the last tile's MMAs are done with Ps
    gather_patches(Ps, ldp, x, k_off, v, b, t0, count);
    __syncthreads();
    for (int unit = warp; unit < units; unit += kWarps) {
      const int e0 = unit / 2 * 16, n0 = unit % 2 * kWarpTokens;
      if (n0 >= count) continue;
      uint32_t a[kMaxPatch / 16][4];
#pragma unroll
      for (int ks = 0; ks < kMaxPatch / 16; ++ks) {
        if (ks < ksteps) ldmatrix_x4(a[ks], Ws + (e0 + lane % 16) * ldw + ks * 16 + lane / 16 * 8);
      }
      const float bias_lo = bias ? to_float(bias[e0 + g]) : 0.f, bias_hi = bias ? to_float(bias[e0 + g + 8]) : 0.f;
#pragma unroll
      for (int j = 0; j < kWarpTokens / 8; ++j) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < kMaxPatch / 16; ++ks) {
          if (ks < ksteps) {
            uint32_t bfrag[2];
            ldmatrix_x2(bfrag, Ps + (n0 + j * 8 + lane % 8) * ldp + ks * 16 + lane / 8 % 2 * 8);
            mma_16816<T>(acc, a[ks], bfrag);
          }
        }
        // acc: rows g and g + 8 of the 16-row block, tokens 2q and 2q + 1 of n-tile j.
        my_stage[g * kStagePitch + j * 4 + q] = pack2<T>(acc[0] + bias_lo, acc[1] + bias_lo);
        my_stage[(g + 8) * kStagePitch + j * 4 + q] = pack2<T>(acc[2] + bias_hi, acc[3] + bias_hi);
      }
      __syncwarp();
      // 16 rows x 64 tokens, 16 bytes (8 tokens) per lane and step: whole 128-byte rows per 8 lanes.
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int r = s * 4 + lane / 8, chunk = lane % 8, t = n0 + chunk * 8;
        if (t < count) {
          const uint4 val = *reinterpret_cast<const uint4*>(my_stage + r * kStagePitch + chunk * 4);
          *reinterpret_cast<uint4*>(y + (b * E + e0 + r) * v.tokens + t0 + t) = val;
        }
      }
      __syncwarp();
    }
  }
#endif
}

// fp32: y[b, e, t0 + t] = W[e] . P[t] + bias[e] on FMA units. A block's tile of kTileTokens tokens is
// gathered as P^T [Kp][kTileTokens] (each thread one token and half its K, so a warp's stores are
// one row); a warp unit is kF32Rows embeddings x kTileTokens tokens, lane l the 4 tokens 4 l ..
// (float4 loads of P^T and stores of y: whole 512-byte rows per warp), W^T [Kp][E] read as
// broadcast float4s.
constexpr int kF32Rows = 8;

__global__ void __launch_bounds__(kThreads) tiny_embed_kernel_f32(Volume v, const float* __restrict__ x,
                                                                  const float* __restrict__ w, int E,
                                                                  const float* __restrict__ bias,
                                                                  float* __restrict__ y) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* Wt = reinterpret_cast<float*>(smem);  // [Kp][E]
  float* Pt = Wt + v.Kp * E;                   // [Kp][kTileTokens]
  int64_t* k_off = reinterpret_cast<int64_t*>(Pt + v.Kp * kTileTokens);
  for (int i = threadIdx.x; i < E * v.Kp; i += kThreads) {
    const int k = i / E, e = i % E;
    Wt[i] = k < v.K ? w[e * v.K + k] : 0.f;
  }
  fill_element_offsets(k_off, v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t per_sample = (v.tokens + kTileTokens - 1) / kTileTokens, tiles = v.batch * per_sample;
  constexpr int kLanesPerToken = kThreads / kTileTokens;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / per_sample;
    const int t0 = static_cast<int>(tile % per_sample) * kTileTokens;
    const int count = min(kTileTokens, v.tokens - t0);
    __syncthreads();  // W^T and k_off ready; the last tile's units are done with Pt
    {
      const int t = threadIdx.x % kTileTokens, first = threadIdx.x / kTileTokens;
      const float* origin = x + patch_start(v, b, t0 + t);
      for (int k = first; k < v.Kp; k += kLanesPerToken) {
        Pt[k * kTileTokens + t] = t < count && k < v.K ? origin[k_off[k]] : 0.f;
      }
    }
    __syncthreads();
    for (int e0 = warp * kF32Rows; e0 < E; e0 += kWarps * kF32Rows) {
      float acc[kF32Rows][4] = {};
      const float* p = Pt + 4 * lane;
      const float* wk = Wt + e0;
#pragma unroll 4
      for (int k = 0; k < v.K; ++k, p += kTileTokens, wk += E) {
        const float4 pv = *reinterpret_cast<const float4*>(p);
        const float4 w_lo = *reinterpret_cast<const float4*>(wk), w_hi = *reinterpret_cast<const float4*>(wk + 4);
        const float we[kF32Rows] = {w_lo.x, w_lo.y, w_lo.z, w_lo.w, w_hi.x, w_hi.y, w_hi.z, w_hi.w};
#pragma unroll
        for (int r = 0; r < kF32Rows; ++r) {
          acc[r][0] = fmaf(we[r], pv.x, acc[r][0]);
          acc[r][1] = fmaf(we[r], pv.y, acc[r][1]);
          acc[r][2] = fmaf(we[r], pv.z, acc[r][2]);
          acc[r][3] = fmaf(we[r], pv.w, acc[r][3]);
        }
      }
      if (4 * lane >= count) continue;  // count % 4 == 0: N % 8 == 0
#pragma unroll
      for (int r = 0; r < kF32Rows; ++r) {
        const float bv = bias ? bias[e0 + r] : 0.f;
        *reinterpret_cast<float4*>(y + (b * E + e0 + r) * v.tokens + t0 + 4 * lane) =
            make_float4(acc[r][0] + bv, acc[r][1] + bv, acc[r][2] + bv, acc[r][3] + bv);
      }
    }
  }
}

}  // namespace

bool tiny_embed(const at::Tensor& x5, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                const PatchGeometry& g, const at::Tensor& y, std::string& why) {
  const int64_t E = w2.size(0), K = g.patch_size(), N = g.tokens();
  const auto dtype = x5.scalar_type();
  const bool f32 = dtype == at::kFloat;
  if (dtype != at::kHalf && dtype != at::kBFloat16 && !f32) return decline(why, "16-bit and fp32 only");
  if (g.levels.size() != 1) return decline(why, "row-major token order only (no levels)");
  if (K == 0 || K > kMaxPatch) return decline(why, "patches of 1 to 64 elements only");
  if (E % (f32 ? kF32Rows : 16) || E > 512)
    return decline(why, f32 ? "E must be a multiple of 8, at most 512" : "E must be a multiple of 16, at most 512");
  if (N % 8 || N > INT_MAX) return decline(why, "patches per sample must be a multiple of 8");
  if (g.batch * E * N == 0) return decline(why, "empty problem");
  if (at::cuda::getDeviceProperties(x5.get_device())->major < 8) return decline(why, "needs sm_80 or newer");
  Volume v;
  for (int d = 0; d < 5; ++d) v.stride[d] = x5.size(d) == 1 ? 0 : x5.stride(d);
  v.kd = static_cast<int>(g.kernel[0]);
  v.kh = static_cast<int>(g.kernel[1]);
  v.kw = static_cast<int>(g.kernel[2]);
  v.K = static_cast<int>(K);
  v.Kp = static_cast<int>((K + 15) / 16 * 16);
  v.gh = static_cast<int>(g.grid[1]);
  v.gw = static_cast<int>(g.grid[2]);
  v.tokens = static_cast<int>(N);
  v.batch = g.batch;
  // Pairs along w: w contiguous, kw even, every offset of a pair 4-byte aligned.
  bool pairs = v.kw % 2 == 0 && (x5.size(4) == 1 || x5.stride(4) == 1) &&
               reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % 4 == 0;
  for (int d = 0; d < 4; ++d) pairs = pairs && v.stride[d] % 2 == 0;
  v.unit = pairs ? 2 : 1;

  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor w = w2.contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  const int64_t smem = f32 ? (E + kTileTokens) * v.Kp * 4 + kMaxPatch * 8
                           : (E + kTileTokens) * (v.Kp + 8) * 2 + kWarps * 16 * kStagePitch * 4 + kMaxPatch * 8;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    constexpr auto kernel = [] {
      if constexpr (std::is_same_v<T, float>) {
        return tiny_embed_kernel_f32;
      } else {
        return tiny_embed_kernel<T>;
      }
    }();
    const LaunchShape shape = prepare_launch(reinterpret_cast<const void*>(kernel), kThreads, static_cast<int>(smem));
    TORCH_CHECK(shape.blocks_per_sm > 0, "tiny_embed: ", smem, " bytes of shared memory fit no block on this GPU");
    const int64_t tiles = g.batch * ((N + kTileTokens - 1) / kTileTokens);
    const int64_t blocks =
        std::min<int64_t>(tiles, int64_t{shape.blocks_per_sm} * shape.sms);
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        v, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(w.const_data_ptr()), static_cast<int>(E),
        bias ? static_cast<const T*>(b.const_data_ptr()) : nullptr, static_cast<T*>(y.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  };
  if (f32) return run(float{});
  return dtype == at::kHalf ? run(__half{}) : run(__nv_bfloat16{});
}

}  // namespace cuda
}  // namespace patchgemm
