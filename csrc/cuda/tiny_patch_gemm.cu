// Fused kernels for patches of at most 64 elements (tiny K: P3's Conv3d(4, E, 2), U2's
// ConvTranspose3d(C, 4, 2)). There the GEMM is so thin that gather -> GEMM -> scatter is pure data
// movement: each kernel reads the volume through its strides and the token-side tensor
// (channels-first [B, features, N]) once, and multiplies on tensor cores (WMMA, fp32
// accumulation) in shared memory, so no patch matrix ever reaches global memory.
//
//   tiny_embed        y[b, :, tokens] = W [E, K] @ patches^T (+ bias)   (patch_embed; unembed's dx)
//   tiny_unembed      volume patches = x[b, :, tokens]^T @ W [C_in, K] (+ bias), scattered
//                     (patch_unembed; embed's dx)
//   tiny_weight_grad  [dW | db] [E, K + 1] += G[b, :, tokens] @ [patches | 1]  (both weight grads)
//
// A block takes token tiles in a grid-stride loop, so the weight is loaded into shared memory once
// per block. Volume offsets come from two small tables, token offset + in-patch offset, which
// serve any input strides. 16-bit dtypes only (fp32 stays on cuBLAS: WMMA would mean TF32).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <climits>
#include <functional>

#include "patchify.h"

namespace patchgemm {
namespace cuda {
namespace {

using namespace nvcuda;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxPatch = 64;  // K (+1 for the bias column of the weight gradient), padded to 16
constexpr int kBatch = 8;      // independent loads in flight per thread

// The volume side: [B, C, D, H, W] with any strides, cut into kd x kh x kw patches, tokens in
// row-major grid order.
struct Volume {
  int64_t stride[5];
  int channels, kd, kh, kw, K;  // K = channels * kd * kh * kw
  int gd, gh, gw;
  int64_t tokens, batch;        // N per sample, B
};

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ __half from_float<__half>(float f) { return __float2half_rn(f); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }
__device__ __forceinline__ float to_float(__half h) { return __half2float(h); }
__device__ __forceinline__ float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }

__device__ __forceinline__ int round16(int n) { return (n + 15) / 16 * 16; }

// Offset of patch element k = ((c * kd + i) * kh + j) * kw + l from its patch's origin.
__device__ void fill_patch_offsets(int64_t* k_off, const Volume& v) {
  for (int k = threadIdx.x; k < v.K; k += kThreads) {
    const int l = k % v.kw, j = k / v.kw % v.kh, i = k / (v.kw * v.kh) % v.kd, c = k / (v.kw * v.kh * v.kd);
    k_off[k] = c * v.stride[1] + i * v.stride[2] + j * v.stride[3] + l * v.stride[4];
  }
}

// Offset of each token's patch origin, for tokens t0 .. t0 + count - 1 of sample b.
__device__ void fill_token_offsets(int64_t* t_off, const Volume& v, int64_t b, int64_t t0, int count) {
  for (int t = threadIdx.x; t < count; t += kThreads) {
    const int64_t n = t0 + t;
    const int64_t nw = n % v.gw, nh = n / v.gw % v.gh, nd = n / (int64_t{v.gw} * v.gh);
    t_off[t] = b * v.stride[0] + nd * v.kd * v.stride[2] + nh * v.kh * v.stride[3] + nw * v.kw * v.stride[4];
  }
}

// P[t, k] (row pitch ld) for the tile's tokens: thread order (k / kw, t, k % kw), so a warp reads
// runs along w. Rows past `count` are zero; columns K.. are set by the caller.
template <typename T, int TM>
__device__ __forceinline__ void gather_patches(T* P, int ld, const T* __restrict__ vol, const int64_t* t_off,
                                               const int64_t* k_off, const Volume& v, int count) {
  const int total = TM * v.K;
  for (int i0 = threadIdx.x; i0 < total; i0 += kThreads * kBatch) {
    T val[kBatch];
    int at[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int idx = i0 + q * kThreads;
      at[q] = -1;
      if (idx < total) {
        const int l = idx % v.kw, r = idx / v.kw, t = r % TM, k = r / TM * v.kw + l;
        at[q] = t * ld + k;
        val[q] = t < count ? vol[t_off[t] + k_off[k]] : from_float<T>(0.f);
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      if (at[q] >= 0) P[at[q]] = val[q];
    }
  }
}

// rows x TM elements of a channels-first tensor (row r at src + r * row_stride, tokens contiguous)
// into S (pitch ld), 16-byte vectors; tokens past `count` are zero. The host guarantees alignment
// and count % 8 == 0.
template <typename T, int TM>
__device__ __forceinline__ void load_token_rows(T* S, int ld, const T* __restrict__ src, int64_t row_stride,
                                                int rows, int count) {
  constexpr int kVec = 8, kPerRow = TM / kVec;
  const int total = rows * kPerRow;
  for (int i0 = threadIdx.x; i0 < total; i0 += kThreads * kBatch) {
    uint4 val[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int idx = i0 + q * kThreads, r = idx / kPerRow, t = idx % kPerRow * kVec;
      if (idx < total) {
        val[q] = t < count ? *reinterpret_cast<const uint4*>(src + r * row_stride + t) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int idx = i0 + q * kThreads, r = idx / kPerRow, t = idx % kPerRow * kVec;
      if (idx < total) *reinterpret_cast<uint4*>(S + r * ld + t) = val[q];
    }
  }
}

__device__ __forceinline__ int64_t tiles_per_sample(const Volume& v, int tm) { return (v.tokens + tm - 1) / tm; }
// Tokens in the tile starting at t0 (the last tile of a sample may be short).
__device__ __forceinline__ int tile_count(const Volume& v, int64_t t0, int tm) {
  return v.tokens - t0 < tm ? static_cast<int>(v.tokens - t0) : tm;
}

template <typename T>
__device__ __forceinline__ T* carve(unsigned char*& p, int64_t elements) {
  T* out = reinterpret_cast<T*>(p);
  p += (elements * sizeof(T) + 127) / 128 * 128;
  return out;
}

// ---- y [B, E, N] = W [E, K] @ P^T (+ bias) --------------------------------------------------------

constexpr int kEmbedTokens = 128, kEmbedRows = 32;  // tokens per tile, output rows per pass

template <typename T>
__global__ void __launch_bounds__(kThreads) tiny_embed_kernel(Volume v, const T* __restrict__ vol,
                                                              const T* __restrict__ w, int E,
                                                              const T* __restrict__ bias, T* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
  constexpr int TM = kEmbedTokens, EC = kEmbedRows;
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = round16(v.K), ldw = Kp + 8, ldp = Kp + 8, ldc = TM + 4;
  unsigned char* p = smem;
  T* Ws = carve<T>(p, int64_t{E} * ldw);
  T* Ps = carve<T>(p, int64_t{TM} * ldp);
  float* Cs = carve<float>(p, int64_t{EC} * ldc);
  int64_t* k_off = carve<int64_t>(p, kMaxPatch);
  int64_t* t_off = carve<int64_t>(p, TM);

  for (int i = threadIdx.x; i < E * Kp; i += kThreads) Ws[i / Kp * ldw + i % Kp] = w[i];
  for (int i = threadIdx.x; i < TM * (Kp - v.K); i += kThreads) {
    Ps[i / (Kp - v.K) * ldp + v.K + i % (Kp - v.K)] = from_float<T>(0.f);
  }
  fill_patch_offsets(k_off, v);
  const int warp = threadIdx.x / 32;
  const int64_t per_sample = tiles_per_sample(v, TM), tiles = v.batch * per_sample;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / per_sample, t0 = tile % per_sample * TM;
    const int count = tile_count(v, t0, TM);
    __syncthreads();  // the last tile is done with t_off and Ps
    fill_token_offsets(t_off, v, b, t0, count);
    __syncthreads();
    gather_patches<T, TM>(Ps, ldp, vol, t_off, k_off, v, count);
    __syncthreads();
    for (int e0 = 0; e0 < E; e0 += EC) {
      const int rows = min(EC, E - e0);  // a multiple of 16
      for (int f = warp; f < rows / 16 * (TM / 16); f += kWarps) {
        const int et = f / (TM / 16), tt = f % (TM / 16);
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < Kp; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bt;
          wmma::load_matrix_sync(a, Ws + (e0 + et * 16) * ldw + kk, ldw);
          wmma::load_matrix_sync(bt, Ps + tt * 16 * ldp + kk, ldp);
          wmma::mma_sync(acc, a, bt, acc);
        }
        wmma::store_matrix_sync(Cs + et * 16 * ldc + tt * 16, acc, ldc, wmma::mem_row_major);
      }
      __syncthreads();
      // rows x count outputs, 8 tokens (16 bytes) per thread and step.
      const int vectors = rows * (count / 8);
      for (int i = threadIdx.x; i < vectors; i += kThreads) {
        const int r = i / (count / 8), t = i % (count / 8) * 8;
        const float add = bias ? to_float(bias[e0 + r]) : 0.f;
        const float4 lo = *reinterpret_cast<const float4*>(Cs + r * ldc + t);
        const float4 hi = *reinterpret_cast<const float4*>(Cs + r * ldc + t + 4);
        alignas(16) T out[8] = {from_float<T>(lo.x + add), from_float<T>(lo.y + add), from_float<T>(lo.z + add),
                                from_float<T>(lo.w + add), from_float<T>(hi.x + add), from_float<T>(hi.y + add),
                                from_float<T>(hi.z + add), from_float<T>(hi.w + add)};
        *reinterpret_cast<uint4*>(y + (b * E + e0 + r) * v.tokens + t0 + t) = *reinterpret_cast<const uint4*>(out);
      }
      __syncthreads();
    }
  }
#endif
}

// ---- volume patches = x[b, :, tokens]^T @ W [C_in, K] (+ bias[c]) ---------------------------------

constexpr int kUnembedTokens = 64;

template <typename T>
__global__ void __launch_bounds__(kThreads) tiny_unembed_kernel(Volume v, const T* __restrict__ x,
                                                                int64_t x_batch_stride, int64_t x_row_stride,
                                                                int c_in, const T* __restrict__ w,
                                                                const T* __restrict__ bias, T* __restrict__ vol) {
#if __CUDA_ARCH__ >= 800
  constexpr int TM = kUnembedTokens;
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = round16(v.K), ldw = Kp + 8, ldx = TM + 8, ldq = Kp + 4;
  const int kvol = v.kd * v.kh * v.kw;
  unsigned char* p = smem;
  T* Ws = carve<T>(p, int64_t{c_in} * ldw);
  T* Xs = carve<T>(p, int64_t{c_in} * ldx);
  float* Qs = carve<float>(p, int64_t{TM} * ldq);
  int64_t* k_off = carve<int64_t>(p, kMaxPatch);
  int64_t* t_off = carve<int64_t>(p, TM);

  for (int i = threadIdx.x; i < c_in * Kp; i += kThreads) Ws[i / Kp * ldw + i % Kp] = w[i];
  fill_patch_offsets(k_off, v);
  const int warp = threadIdx.x / 32;
  const int64_t per_sample = tiles_per_sample(v, TM), tiles = v.batch * per_sample;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / per_sample, t0 = tile % per_sample * TM;
    const int count = tile_count(v, t0, TM);
    __syncthreads();  // the last tile is done with t_off, Xs and Qs
    fill_token_offsets(t_off, v, b, t0, count);
    load_token_rows<T, TM>(Xs, ldx, x + b * x_batch_stride + t0, x_row_stride, c_in, count);
    __syncthreads();
    // Q [TM, Kp] = X^T [TM, C_in] @ W [C_in, Kp]; X^T is Xs read column-major.
    for (int f = warp; f < TM / 16 * (Kp / 16); f += kWarps) {
      const int tt = f / (Kp / 16), kt = f % (Kp / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int cc = 0; cc < c_in; cc += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bw;
        wmma::load_matrix_sync(a, Xs + cc * ldx + tt * 16, ldx);
        wmma::load_matrix_sync(bw, Ws + cc * ldw + kt * 16, ldw);
        wmma::mma_sync(acc, a, bw, acc);
      }
      wmma::store_matrix_sync(Qs + tt * 16 * ldq + kt * 16, acc, ldq, wmma::mem_row_major);
    }
    __syncthreads();
    // Scatter, thread order (k / kw, t, k % kw): a warp writes runs along w.
    const int total = TM * v.K;
    for (int idx = threadIdx.x; idx < total; idx += kThreads) {
      const int l = idx % v.kw, r = idx / v.kw, t = r % TM, k = r / TM * v.kw + l;
      if (t < count) {
        const float add = bias ? to_float(bias[k / kvol]) : 0.f;
        vol[t_off[t] + k_off[k]] = from_float<T>(Qs[t * ldq + k] + add);
      }
    }
  }
#endif
}

// ---- [dW | db] [E, Kp] += G[b, :, tokens] @ [P | 1 | 0] ------------------------------------------

constexpr int kGradTokens = 64, kMaxFragments = 6;  // accumulator tiles per warp: E * Kp <= 12288

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) tiny_weight_grad_kernel(Volume v, const T* __restrict__ vol,
                                                                    const T* __restrict__ g,
                                                                    int64_t g_batch_stride, int64_t g_row_stride,
                                                                    int E, int Kp, float* __restrict__ dw) {
#if __CUDA_ARCH__ >= 800
  constexpr int TM = kGradTokens;
  extern __shared__ __align__(128) unsigned char smem[];
  const int ldg = TM + 8, ldp = Kp + 8, ldc = Kp + 4;
  unsigned char* p = smem;
  // G's tile, and at the end the fp32 partial sums, share the first region.
  unsigned char* shared_region = p;
  T* Gs = carve<T>(p, int64_t{E} * (ldg > 2 * ldc ? ldg : 2 * ldc));
  T* Ps = carve<T>(p, int64_t{TM} * ldp);
  int64_t* k_off = carve<int64_t>(p, kMaxPatch);
  int64_t* t_off = carve<int64_t>(p, TM);

  fill_patch_offsets(k_off, v);
  const int warp = threadIdx.x / 32, fragments = E / 16 * (Kp / 16);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMaxFragments];
#pragma unroll
  for (int f = 0; f < kMaxFragments; ++f) wmma::fill_fragment(acc[f], 0.f);
  const int64_t per_sample = tiles_per_sample(v, TM), tiles = v.batch * per_sample;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / per_sample, t0 = tile % per_sample * TM;
    const int count = tile_count(v, t0, TM);
    __syncthreads();  // the last tile is done with t_off, Gs and Ps
    fill_token_offsets(t_off, v, b, t0, count);
    // Columns K.. of P: the ones column (bias gradient) and zeros; zero rows past `count`.
    for (int i = threadIdx.x; i < TM * (Kp - v.K); i += kThreads) {
      const int t = i / (Kp - v.K), k = v.K + i % (Kp - v.K);
      Ps[t * ldp + k] = from_float<T>(k == v.K && t < count ? 1.f : 0.f);
    }
    load_token_rows<T, TM>(Gs, ldg, g + b * g_batch_stride + t0, g_row_stride, E, count);
    __syncthreads();
    gather_patches<T, TM>(Ps, ldp, vol, t_off, k_off, v, count);
    __syncthreads();
#pragma unroll
    for (int f = 0; f < kMaxFragments; ++f) {
      const int id = warp + f * kWarps;
      if (id < fragments) {
        const int et = id / (Kp / 16), kt = id % (Kp / 16);
        for (int tt = 0; tt < TM; tt += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bp;
          wmma::load_matrix_sync(a, Gs + et * 16 * ldg + tt, ldg);
          wmma::load_matrix_sync(bp, Ps + tt * ldp + kt * 16, ldp);
          wmma::mma_sync(acc[f], a, bp, acc[f]);
        }
      }
    }
  }
  __syncthreads();
  float* Cs = reinterpret_cast<float*>(shared_region);
#pragma unroll
  for (int f = 0; f < kMaxFragments; ++f) {
    const int id = warp + f * kWarps;
    if (id < fragments) {
      const int et = id / (Kp / 16), kt = id % (Kp / 16);
      wmma::store_matrix_sync(Cs + et * 16 * ldc + kt * 16, acc[f], ldc, wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < E * Kp; i += kThreads) atomicAdd(dw + i, Cs[i / Kp * ldc + i % Kp]);
#endif
}

// ---- host side -------------------------------------------------------------------------------------

int64_t round16_host(int64_t n) { return (n + 15) / 16 * 16; }

// w2 [rows, K] as [rows, width] with zero columns after K (whole 16-wide MMA steps).
at::Tensor padded_weight_for_tiles(const at::Tensor& w2, int64_t width) {
  at::Tensor w = at::zeros({w2.size(0), width}, w2.options());
  w.narrow(1, 0, w2.size(1)).copy_(w2);
  return w;
}

bool tensor_cores_for(const at::Tensor& t) {
  if (t.scalar_type() != at::kHalf && t.scalar_type() != at::kBFloat16) return false;
  return at::cuda::getDeviceProperties(t.get_device())->major >= 8;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The volume side, or false where the kernels do not apply: tokens in row-major order, K small,
// sizes inside int.
bool volume_of(const at::Tensor& v5, const PatchGeometry& g, int extra_columns, Volume& v) {
  if (g.levels.size() != 1 || g.patch_size() + extra_columns > kMaxPatch || g.patch_size() == 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (g.grid[d] > INT_MAX) return false;
  }
  for (int d = 0; d < 5; ++d) v.stride[d] = v5.size(d) == 1 ? 0 : v5.stride(d);
  v.channels = static_cast<int>(g.channels);
  v.kd = static_cast<int>(g.kernel[0]);
  v.kh = static_cast<int>(g.kernel[1]);
  v.kw = static_cast<int>(g.kernel[2]);
  v.K = static_cast<int>(g.patch_size());
  v.gd = static_cast<int>(g.grid[0]);
  v.gh = static_cast<int>(g.grid[1]);
  v.gw = static_cast<int>(g.grid[2]);
  v.tokens = g.tokens();
  v.batch = g.batch;
  return true;
}

// A channels-first token-side tensor t [B, rows, N]: contiguous tokens, rows of 16-byte-aligned
// starts, N a multiple of 8 (whole 16-byte vectors per tile).
bool token_rows_ok(const at::Tensor& t) {
  return t.stride(2) == 1 && t.size(2) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(0) % 8 == 0 &&
         aligned16(t.const_data_ptr());
}

template <typename Kernel>
bool launch(Kernel kernel, int64_t tiles, int64_t smem, const std::function<void(dim3)>& go) {
  if (smem > 200 * 1024) return false;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  if (per_sm == 0) return false;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  go(dim3(static_cast<unsigned>(std::min<int64_t>(tiles, sms * per_sm))));
  return true;
}

int64_t carved(int64_t elements, int64_t bytes_each) { return (elements * bytes_each + 127) / 128 * 128; }

template <typename F>
void dispatch_16bit(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(__half{});
  } else {
    f(__nv_bfloat16{});
  }
}

}  // namespace

bool tiny_embed(const at::Tensor& x5, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                const PatchGeometry& g, const at::Tensor& y) {
  Volume v;
  const int64_t E = w.size(0);
  if (!tensor_cores_for(x5) || !volume_of(x5, g, 0, v) || E % 16 || E * round16_host(v.K) > 16384 ||
      !y.is_contiguous() || !token_rows_ok(y) || g.batch * E * g.tokens() == 0) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t Kp = round16_host(v.K);
  const at::Tensor wp = padded_weight_for_tiles(w, Kp);
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  const int64_t tiles = g.batch * ((g.tokens() + kEmbedTokens - 1) / kEmbedTokens);
  const int64_t smem = carved(E * (Kp + 8), 2) + carved(kEmbedTokens * (Kp + 8), 2) +
                       carved(kEmbedRows * (kEmbedTokens + 4), 4) + carved(kMaxPatch, 8) + carved(kEmbedTokens, 8);
  bool ok = false;
  dispatch_16bit(x5.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ok = launch(tiny_embed_kernel<T>, tiles, smem, [&](dim3 grid) {
      tiny_embed_kernel<T><<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
          v, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(wp.const_data_ptr()),
          static_cast<int>(E), bias ? static_cast<const T*>(b.const_data_ptr()) : nullptr,
          static_cast<T*>(y.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return ok;
}

bool tiny_unembed(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  const PatchGeometry& g, const at::Tensor& y5) {
  Volume v;
  const int64_t c_in = w.size(0);
  if (!tensor_cores_for(x) || !volume_of(y5, g, 0, v) || c_in % 16 || c_in > 256 || !token_rows_ok(x) ||
      g.batch * c_in * g.tokens() == 0) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(y5.device());
  const int64_t Kp = round16_host(v.K);
  const at::Tensor wp = padded_weight_for_tiles(w, Kp);
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  const int64_t tiles = g.batch * ((g.tokens() + kUnembedTokens - 1) / kUnembedTokens);
  const int64_t smem = carved(c_in * (Kp + 8), 2) + carved(c_in * (kUnembedTokens + 8), 2) +
                       carved(kUnembedTokens * (Kp + 4), 4) + carved(kMaxPatch, 8) + carved(kUnembedTokens, 8);
  bool ok = false;
  dispatch_16bit(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ok = launch(tiny_unembed_kernel<T>, tiles, smem, [&](dim3 grid) {
      tiny_unembed_kernel<T><<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
          v, static_cast<const T*>(x.const_data_ptr()), x.stride(0), x.stride(1), static_cast<int>(c_in),
          static_cast<const T*>(wp.const_data_ptr()), bias ? static_cast<const T*>(b.const_data_ptr()) : nullptr,
          static_cast<T*>(y5.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return ok;
}

std::optional<at::Tensor> tiny_weight_grad(const at::Tensor& grad_y, const at::Tensor& x5,
                                           const PatchGeometry& g) {
  Volume v;
  const int64_t E = grad_y.size(1);
  // Accumulation order across blocks (fp32 atomics) varies run to run: not under deterministic mode.
  if (!tensor_cores_for(x5) || at::globalContext().deterministicAlgorithms() || !volume_of(x5, g, 1, v) ||
      E % 16 || E > 256 || E * round16_host(v.K + 1) > kMaxFragments * kWarps * 256 || !token_rows_ok(grad_y) ||
      g.batch * g.tokens() == 0) {
    return std::nullopt;
  }
  const c10::cuda::CUDAGuard guard(x5.device());
  const int64_t Kp = round16_host(v.K + 1), TM = kGradTokens;
  at::Tensor dw = at::zeros({E, Kp}, x5.options().dtype(at::kFloat));
  const int64_t tiles = g.batch * ((g.tokens() + TM - 1) / TM);
  const int64_t smem = carved(std::max(E * (TM + 8), E * (Kp + 4) * 2), 2) + carved(TM * (Kp + 8), 2) +
                       carved(kMaxPatch, 8) + carved(TM, 8);
  bool ok = false;
  dispatch_16bit(x5.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ok = launch(tiny_weight_grad_kernel<T>, tiles, smem, [&](dim3 grid) {
      tiny_weight_grad_kernel<T><<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
          v, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(grad_y.const_data_ptr()),
          grad_y.stride(0), grad_y.stride(1), static_cast<int>(E), static_cast<int>(Kp), dw.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (!ok) return std::nullopt;
  return dw;
}

}  // namespace cuda
}  // namespace patchgemm
