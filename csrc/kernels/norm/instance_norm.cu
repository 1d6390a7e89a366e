// Fused instance norm + GELU (see instance_norm.h): four memory-bound kernels.
//
//   channel_sums  per (sample, channel) partial sums of two terms over a chunk of S: the forward
//                 sums x - k and (x - k)^2 (k = the channel's first element: a shift that keeps
//                 the variance free of cancellation), the backward dz and dz * xhat.
//   finish_*      adds a channel's partials (in double) into the coefficients of the
//                 element-wise pass and mean/rstd (forward) or dweight/dbias (backward).
//   apply         one element-wise pass: y = act(z), or grad_x from dz; linear in x and dz with
//                 per-(sample, channel) coefficients.
// Every access is a 16-byte vector where the layout allows (S or C a multiple of the vector, the
// pointers aligned), else one element. channels-first x reads each channel's contiguous run;
// tokens x ([B, S, C]) has each thread own a vector of adjacent channels over many rows.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "kernels/norm/instance_norm.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkElements = 16384;  // per block of channel_sums: enough work to hide latency
constexpr int64_t kMaxChunks = 65535;      // gridDim.y

enum class Pass { kStats, kBackward };

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename scalar_t, typename acc_t>
struct Args {
  const scalar_t* x;
  const scalar_t* dy;      // backward only
  const scalar_t* weight;  // [C] or null
  const scalar_t* bias;    // [C] or null
  const acc_t* mean;       // [B * C]; the backward only
  const acc_t* rstd;
  NormShape shape;
  bool gelu;
};

template <typename acc_t>
__device__ __forceinline__ acc_t gelu_of(acc_t z) {
  return acc_t(0.5) * z * (acc_t(1) + erf(z * acc_t(0.70710678118654752440)));
}

template <typename acc_t>
__device__ __forceinline__ acc_t gelu_grad(acc_t z) {
  const acc_t cdf = acc_t(0.5) * (acc_t(1) + erf(z * acc_t(0.70710678118654752440)));
  return cdf + z * acc_t(0.39894228040143267794) * exp(acc_t(-0.5) * z * z);
}

// What one element contributes at one (sample, channel).
template <typename acc_t>
struct Channel {
  acc_t shift_or_mean = 0, rstd = 1, gamma = 1, beta = 0;
};

template <Pass kPass, typename scalar_t, typename acc_t>
__device__ __forceinline__ Channel<acc_t> channel_of(const Args<scalar_t, acc_t>& a, int64_t b,
                                                     int64_t c) {
  Channel<acc_t> ch;
  const int64_t bc = b * a.shape.channels + c;
  if (kPass == Pass::kStats) {
    const int64_t first = a.shape.tokens ? b * a.shape.spatial * a.shape.channels + c
                                         : bc * a.shape.spatial;
    ch.shift_or_mean = static_cast<acc_t>(a.x[first]);
    return ch;
  }
  ch.shift_or_mean = a.mean[bc];
  ch.rstd = a.rstd[bc];
  if (a.weight) ch.gamma = static_cast<acc_t>(a.weight[c]);
  if (a.bias) ch.beta = static_cast<acc_t>(a.bias[c]);
  return ch;
}

// dz (the gradient at the affine output z = xhat * gamma + beta) and xhat of one element.
template <typename acc_t>
__device__ __forceinline__ void dz_xhat(acc_t x, acc_t dy, const Channel<acc_t>& ch, bool gelu,
                                        acc_t& dz, acc_t& xhat) {
  const acc_t centered = x - ch.shift_or_mean;
  xhat = centered * ch.rstd;
  dz = gelu ? dy * gelu_grad(centered * (ch.rstd * ch.gamma) + ch.beta) : dy;
}

template <Pass kPass, typename acc_t>
__device__ __forceinline__ void add_terms(acc_t x, acc_t dy, const Channel<acc_t>& ch, bool gelu,
                                          acc_t& t1, acc_t& t2) {
  if (kPass == Pass::kStats) {
    const acc_t d = x - ch.shift_or_mean;
    t1 += d;
    t2 += d * d;
  } else {
    acc_t dz, xhat;
    dz_xhat(x, dy, ch, gelu, dz, xhat);
    t1 += dz;
    t2 += dz * xhat;
  }
}

template <typename scalar_t, int V>
struct alignas(sizeof(scalar_t) * V) Vec {
  scalar_t v[V];
};

template <typename scalar_t, int V>
__device__ __forceinline__ Vec<scalar_t, V> load(const scalar_t* p) {
  return *reinterpret_cast<const Vec<scalar_t, V>*>(p);
}

// Sums a and b over the block's threads (every thread contributes, idle ones zeros).
template <typename acc_t>
__device__ __forceinline__ void block_sum(acc_t& a, acc_t& b) {
  __shared__ acc_t sa[kThreads], sb[kThreads];
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sa[threadIdx.x] += sa[threadIdx.x + half];
      sb[threadIdx.x] += sb[threadIdx.x + half];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
}

// Calls add(x[e .. e + V), dy[e .. e + V)) for e = first, first + step, ... < end (dy: the backward
// only), issuing the loads of kUnroll vectors before adding any: a streaming reduction needs many
// loads in flight per thread to keep HBM busy.
template <Pass kPass, typename scalar_t, int V, typename Add>
__device__ __forceinline__ void stream_rows(const scalar_t* x, const scalar_t* dy, int64_t first, int64_t end,
                                            int64_t step, const Add& add) {
  constexpr int kUnroll = 4;
  int64_t e = first;
  for (; e + (kUnroll - 1) * step < end; e += kUnroll * step) {
    Vec<scalar_t, V> xv[kUnroll], dv[kUnroll] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      xv[u] = load<scalar_t, V>(x + e + u * step);
      if (kPass == Pass::kBackward) dv[u] = load<scalar_t, V>(dy + e + u * step);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) add(xv[u], dv[u]);
  }
  for (; e < end; e += step) {
    Vec<scalar_t, V> dv{};
    if (kPass == Pass::kBackward) dv = load<scalar_t, V>(dy + e);
    add(load<scalar_t, V>(x + e), dv);
  }
}

// channels-first: block (chunk, b * C + c) sums its chunk of the channel's contiguous run.
template <Pass kPass, typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kThreads)
    channel_sums_cf(Args<scalar_t, acc_t> a, int64_t chunk, acc_t* part1, acc_t* part2) {
  const int64_t bc = blockIdx.x, S = a.shape.spatial;
  const Channel<acc_t> ch = channel_of<kPass>(a, bc / a.shape.channels, bc % a.shape.channels);
  const int64_t begin = blockIdx.y * chunk, end = imin(S, begin + chunk);
  acc_t t1 = 0, t2 = 0;
  const auto add_vectors = [&](const Vec<scalar_t, V>& xv, const Vec<scalar_t, V>& dv) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      add_terms<kPass>(static_cast<acc_t>(xv.v[i]), static_cast<acc_t>(dv.v[i]), ch, a.gelu, t1, t2);
    }
  };
  const scalar_t* x = a.x + bc * S;
  const scalar_t* dy = kPass == Pass::kBackward ? a.dy + bc * S : nullptr;
  stream_rows<kPass, scalar_t, V>(x, dy, begin + threadIdx.x * V, end, kThreads * V, add_vectors);
  block_sum(t1, t2);
  if (threadIdx.x == 0) {
    const int64_t i = static_cast<int64_t>(blockIdx.y) * gridDim.x + bc;
    part1[i] = t1;
    part2[i] = t2;
  }
}

// tokens: block (chunk of rows, b, channel tile); thread (tx, ty) owns channels
// [(tile * cols + tx) * V, +V) and rows ty, ty + rows_per_pass, ... of the chunk.
template <Pass kPass, typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kThreads)
    channel_sums_tokens(Args<scalar_t, acc_t> a, int64_t chunk, int cols, acc_t* part1,
                        acc_t* part2) {
  const int64_t C = a.shape.channels, S = a.shape.spatial, b = blockIdx.y;
  const int tx = threadIdx.x % cols, ty = threadIdx.x / cols, rows_per_pass = kThreads / cols;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.z) * cols + tx) * V;
  const bool active = ty < rows_per_pass && c0 < C;
  acc_t t1[V] = {}, t2[V] = {};
  if (active) {
    Channel<acc_t> ch[V];
#pragma unroll
    for (int i = 0; i < V; ++i) ch[i] = channel_of<kPass>(a, b, c0 + i);
    const int64_t begin = blockIdx.x * chunk, end = imin(S, begin + chunk);
    // Rows s of the sample as elements s * C of the channel run starting at (b, c0).
    const scalar_t* x = a.x + b * S * C + c0;
    const scalar_t* dy = kPass == Pass::kBackward ? a.dy + b * S * C + c0 : nullptr;
    stream_rows<kPass, scalar_t, V>(x, dy, (begin + ty) * C, end * C, rows_per_pass * C,
                                    [&](const Vec<scalar_t, V>& xv, const Vec<scalar_t, V>& dv) {
#pragma unroll
                                      for (int i = 0; i < V; ++i) {
                                        add_terms<kPass>(static_cast<acc_t>(xv.v[i]), static_cast<acc_t>(dv.v[i]),
                                                         ch[i], a.gelu, t1[i], t2[i]);
                                      }
                                    });
  }
  // Reduce over ty, one channel vector element at a time (rows of the same tx share channels).
  __shared__ acc_t s1[kThreads], s2[kThreads];
  for (int i = 0; i < V; ++i) {
    s1[threadIdx.x] = t1[i];
    s2[threadIdx.x] = t2[i];
    __syncthreads();
    if (active && ty == 0) {
      acc_t u1 = 0, u2 = 0;
      for (int r = 0; r < rows_per_pass; ++r) {
        u1 += s1[r * cols + tx];
        u2 += s2[r * cols + tx];
      }
      const int64_t j = blockIdx.x * gridDim.y * C + b * C + c0 + i;  // [chunk][b][c]
      part1[j] = u1;
      part2[j] = u2;
    }
    __syncthreads();
  }
}

// Lane `lane ^ offset`'s v, within groups of 32 lanes (a CUDA warp; half a ROCm wavefront, whose
// shuffles take no mask).
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int offset) {
#ifdef USE_ROCM
  return __shfl_xor(v, offset);
#else
  return __shfl_xor_sync(0xffffffffu, v, offset);
#endif
}

// The total of one (sample, channel)'s partials ([chunk][b * C + c]) over its chunks, added by the
// lanes of a warp in a fixed order (tokens x has a hundred or more chunks per channel: one thread
// each would be a long serial chain); every lane gets the totals.
template <typename acc_t>
__device__ __forceinline__ void chunk_totals(const acc_t* part1, const acc_t* part2, int64_t bc, int64_t bcs,
                                             int64_t chunks, int lane, double& u1, double& u2) {
  u1 = 0, u2 = 0;
  for (int64_t i = lane; i < chunks; i += 32) {
    u1 += part1[i * bcs + bc];
    u2 += part2[i * bcs + bc];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    u1 += shfl_xor(u1, offset);
    u2 += shfl_xor(u2, offset);
  }
}

// The coefficients of the element-wise pass for (sample, channel) bc, coef[j][bc]:
//   both:     mean, ca = rstd * gamma, beta; z = (x - mean) * ca + beta, y = act(z)
//   backward: m1 = mean(dz), m2r = mean(dz * xhat) * rstd over the channel;
//             dx = rstd * gamma * (dz - m1 - xhat * m2) = ca * (dz - m1 - (x - mean) * m2r)
// (x - mean is formed first, as PyTorch does: no cancellation between large terms).
template <Pass kPass, typename scalar_t, typename acc_t>
__device__ __forceinline__ void write_coefficients(const Args<scalar_t, acc_t>& a, int64_t bc, double mean,
                                                   double rstd, double u1, double u2, acc_t* coef) {
  const int64_t bcs = a.shape.batch * a.shape.channels, c = bc % a.shape.channels;
  const double n = static_cast<double>(a.shape.spatial);
  const double gamma = a.weight ? static_cast<double>(static_cast<acc_t>(a.weight[c])) : 1.0;
  const double beta = a.bias ? static_cast<double>(static_cast<acc_t>(a.bias[c])) : 0.0;
  coef[bc] = static_cast<acc_t>(mean);
  coef[bcs + bc] = static_cast<acc_t>(rstd * gamma);
  coef[2 * bcs + bc] = static_cast<acc_t>(beta);
  if (kPass == Pass::kBackward) {
    coef[3 * bcs + bc] = static_cast<acc_t>(u1 / n);
    coef[4 * bcs + bc] = static_cast<acc_t>(u2 / n * rstd);
  }
}

// Forward: one warp per (sample, channel) adds its partials into mean and rstd [B * C] and the
// coefficients.
template <typename scalar_t, typename acc_t>
__global__ void finish_stats(Args<scalar_t, acc_t> a, int64_t chunks, const acc_t* part1, const acc_t* part2,
                             double eps, acc_t* mean_out, acc_t* rstd_out, acc_t* coef) {
  const int64_t bcs = a.shape.batch * a.shape.channels;
  const int64_t bc = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (bc >= bcs) return;  // whole warps: bc is the same across a warp
  double u1, u2;
  chunk_totals(part1, part2, bc, bcs, chunks, lane, u1, u2);
  if (lane != 0) return;
  const Channel<acc_t> ch = channel_of<Pass::kStats>(a, bc / a.shape.channels, bc % a.shape.channels);
  const double n = static_cast<double>(a.shape.spatial);
  const double d = u1 / n, var = u2 / n - d * d;
  const double mean = static_cast<double>(ch.shift_or_mean) + d;
  const double rstd = 1.0 / sqrt((var > 0 ? var : 0.0) + eps);
  mean_out[bc] = static_cast<acc_t>(mean);
  rstd_out[bc] = static_cast<acc_t>(rstd);
  write_coefficients<Pass::kStats>(a, bc, mean, rstd, u1, u2, coef);
}

// Backward: one warp per channel, over the samples in order: each (sample, channel)'s sums
// s1 = sum(dz), s2 = sum(dz * xhat) give its coefficients, and their totals over the batch the
// affine gradients, dbias = s1 and dweight = s2, in x's dtype (null where there is no weight / bias).
template <typename scalar_t, typename acc_t>
__global__ void finish_backward(Args<scalar_t, acc_t> a, int64_t chunks, const acc_t* part1, const acc_t* part2,
                                acc_t* coef, scalar_t* grad_weight, scalar_t* grad_bias) {
  const int64_t C = a.shape.channels, bcs = a.shape.batch * C;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (c >= C) return;  // whole warps
  double total1 = 0, total2 = 0;
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    const int64_t bc = b * C + c;
    double u1, u2;
    chunk_totals(part1, part2, bc, bcs, chunks, lane, u1, u2);
    if (lane == 0) {
      write_coefficients<Pass::kBackward>(a, bc, a.mean[bc], a.rstd[bc], u1, u2, coef);
      total1 += u1;
      total2 += u2;
    }
  }
  if (lane != 0) return;
  if (grad_bias) grad_bias[c] = static_cast<scalar_t>(total1);
  if (grad_weight) grad_weight[c] = static_cast<scalar_t>(total2);
}

// The element-wise pass over V-element vectors; a vector never straddles two channels
// (channels-first: S % V == 0) or two samples (tokens: C % V == 0), so its coefficients are one
// value (channels-first) or V adjacent ones (tokens, one vector load each).
template <Pass kPass, typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kThreads)
    apply(Args<scalar_t, acc_t> a, const acc_t* coef, scalar_t* out) {
  const NormShape& s = a.shape;
  const int64_t vectors = s.numel() / V, bcs = s.batch * s.channels;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = v * V;
    const int64_t b = e / (s.spatial * s.channels);
    const int64_t bc = s.tokens ? b * s.channels + e % s.channels : e / s.spatial;
    constexpr int kCoefs = kPass == Pass::kStats ? 3 : 5;
    acc_t k[kCoefs][V];
#pragma unroll
    for (int j = 0; j < kCoefs; ++j) {
      if (s.tokens) {
        const Vec<acc_t, V> kv = load<acc_t, V>(coef + j * bcs + bc);
#pragma unroll
        for (int i = 0; i < V; ++i) k[j][i] = kv.v[i];
      } else {
        const acc_t kj = coef[j * bcs + bc];
#pragma unroll
        for (int i = 0; i < V; ++i) k[j][i] = kj;
      }
    }
    const Vec<scalar_t, V> xv = load<scalar_t, V>(a.x + e);
    Vec<scalar_t, V> dv{}, result;
    if (kPass == Pass::kBackward) dv = load<scalar_t, V>(a.dy + e);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const acc_t centered = static_cast<acc_t>(xv.v[i]) - k[0][i];
      const acc_t z = centered * k[1][i] + k[2][i];
      if (kPass == Pass::kStats) {
        result.v[i] = static_cast<scalar_t>(a.gelu ? gelu_of(z) : z);
      } else {
        const acc_t dy = static_cast<acc_t>(dv.v[i]);
        const acc_t dz = a.gelu ? dy * gelu_grad(z) : dy;
        result.v[i] = static_cast<scalar_t>(k[1][i] * (dz - k[3][i] - centered * k[4][i]));
      }
    }
    *reinterpret_cast<Vec<scalar_t, V>*>(out + e) = result;
  }
}

bool aligned(const void* p, int64_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// The grid of the channel-sums kernels: `chunks` chunks of `chunk` elements of S (channels-first)
// or rows (tokens, where `cols` threads of a block span its channel tile).
struct SumsGrid {
  int64_t chunk = 0, chunks = 0;
  int cols = 0;
  dim3 grid;
};

template <int V>
SumsGrid plan_sums(const NormShape& s) {
  SumsGrid g;
  if (s.tokens) {
    const int64_t col_vectors = s.channels / V;
    g.cols = static_cast<int>(std::min<int64_t>(col_vectors, kThreads));
    const int64_t tiles = (col_vectors + g.cols - 1) / g.cols, rows_per_pass = kThreads / g.cols;
    // One wave of blocks (8 per SM), each thread streaming at least kMinRows rows: fewer, longer
    // chunks keep the per-block reduction and the partials small.
    constexpr int64_t kMinRows = 8;
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    g.chunks = std::max<int64_t>(1, 8 * sms / std::max<int64_t>(1, s.batch * tiles));
    g.chunks =
        std::min({g.chunks, (s.spatial + rows_per_pass * kMinRows - 1) / (rows_per_pass * kMinRows), kMaxChunks});
    g.chunk = (s.spatial + g.chunks - 1) / g.chunks;
    g.chunks = (s.spatial + g.chunk - 1) / g.chunk;
    TORCH_CHECK(s.batch <= 65535 && tiles <= 65535, "instance_norm_act: batch ", s.batch,
                " or channels ", s.channels, " too large for the CUDA kernels");
    g.grid = dim3(static_cast<unsigned>(g.chunks), static_cast<unsigned>(s.batch), static_cast<unsigned>(tiles));
  } else {
    g.chunks = std::min<int64_t>((s.spatial + kChunkElements - 1) / kChunkElements, kMaxChunks);
    g.chunk = (s.spatial + g.chunks - 1) / g.chunks;
    g.chunk = (g.chunk + V - 1) / V * V;  // chunks start on vector boundaries
    g.grid = dim3(static_cast<unsigned>(s.batch * s.channels), static_cast<unsigned>(g.chunks));
  }
  return g;
}

// What a pass's finish writes besides the coefficients: the forward's mean and rstd [B * C], or
// the backward's affine gradients [C] (null where the norm has no weight / bias).
template <typename scalar_t, typename acc_t>
struct Totals {
  acc_t* mean = nullptr;
  acc_t* rstd = nullptr;
  scalar_t* grad_weight = nullptr;
  scalar_t* grad_bias = nullptr;
};

// One direction at vector width V: the partial sums per chunk, their totals and the coefficients
// (finish), then the element-wise pass into `out` (y, or grad_x). Three launches and one scratch
// allocation (coefficients and partials).
template <Pass kPass, typename scalar_t, typename acc_t, int V>
void run(const Args<scalar_t, acc_t>& a, double eps, const Totals<scalar_t, acc_t>& totals,
         const at::TensorOptions& acc_options, scalar_t* out) {
  const NormShape& s = a.shape;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const SumsGrid g = plan_sums<V>(s);
  const int64_t bcs = s.batch * s.channels, coefs = (kPass == Pass::kStats ? 3 : 5) * bcs;
  const at::Tensor scratch = at::empty({coefs + 2 * bcs * g.chunks}, acc_options);
  acc_t* coef = scratch.data_ptr<acc_t>();
  acc_t* p1 = coef + coefs;
  acc_t* p2 = p1 + bcs * g.chunks;
  if (s.tokens) {
    channel_sums_tokens<kPass, scalar_t, acc_t, V><<<g.grid, kThreads, 0, stream>>>(a, g.chunk, g.cols, p1, p2);
  } else {
    channel_sums_cf<kPass, scalar_t, acc_t, V><<<g.grid, kThreads, 0, stream>>>(a, g.chunk, p1, p2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  constexpr int64_t kWarpsPerBlock = kThreads / 32;
  const int64_t warps = kPass == Pass::kStats ? bcs : s.channels;
  const unsigned finish_blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (kPass == Pass::kStats) {
    finish_stats<<<finish_blocks, kThreads, 0, stream>>>(a, g.chunks, p1, p2, eps, totals.mean, totals.rstd, coef);
  } else {
    finish_backward<<<finish_blocks, kThreads, 0, stream>>>(a, g.chunks, p1, p2, coef, totals.grad_weight,
                                                            totals.grad_bias);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t vectors = s.numel() / V;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads,
                                           at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 16);
  apply<kPass, scalar_t, acc_t, V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, coef, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The vector width for this call: 16 bytes when the innermost run (S, or C for tokens) and every
// pointer allow it, else 1.
template <typename scalar_t>
bool can_vectorize(const NormShape& s, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(scalar_t);
  if ((s.tokens ? s.channels : s.spatial) % V != 0) return false;
  for (const void* p : ptrs) {
    if (!aligned(p, 16)) return false;
  }
  return true;
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

}  // namespace

void instance_norm_act_forward(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, double eps, bool gelu, const NormShape& s,
                               const at::Tensor& y, const at::Tensor& mean, const at::Tensor& rstd) {
  if (s.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "instance_norm_act", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    Args<scalar_t, acc_t> a{x.const_data_ptr<scalar_t>(), nullptr, ptr_or_null<scalar_t>(weight),
                            ptr_or_null<scalar_t>(bias), nullptr, nullptr, s, gelu};
    constexpr int V = 16 / sizeof(scalar_t);
    const Totals<scalar_t, acc_t> totals{mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>()};
    if (can_vectorize<scalar_t>(s, {x.const_data_ptr(), y.data_ptr()})) {
      run<Pass::kStats, scalar_t, acc_t, V>(a, eps, totals, mean.options(), y.data_ptr<scalar_t>());
    } else {
      run<Pass::kStats, scalar_t, acc_t, 1>(a, eps, totals, mean.options(), y.data_ptr<scalar_t>());
    }
  });
}

void instance_norm_act_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& mean, const at::Tensor& rstd, bool gelu,
                                const NormShape& s, const at::Tensor& grad_x,
                                const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  if (s.numel() == 0) {  // no element: the affine gradients are sums of nothing
    for (const at::Tensor* t : {&grad_weight, &grad_bias}) {
      if (t->defined()) t->zero_();
    }
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "instance_norm_act_backward", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    Args<scalar_t, acc_t> a{x.const_data_ptr<scalar_t>(), grad_y.const_data_ptr<scalar_t>(),
                            ptr_or_null<scalar_t>(weight), ptr_or_null<scalar_t>(bias),
                            mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(), s, gelu};
    const auto out_or_null = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
    const Totals<scalar_t, acc_t> totals{nullptr, nullptr, out_or_null(grad_weight), out_or_null(grad_bias)};
    constexpr int V = 16 / sizeof(scalar_t);
    if (can_vectorize<scalar_t>(s, {x.const_data_ptr(), grad_y.const_data_ptr(), grad_x.data_ptr()})) {
      run<Pass::kBackward, scalar_t, acc_t, V>(a, 0.0, totals, mean.options(), grad_x.data_ptr<scalar_t>());
    } else {
      run<Pass::kBackward, scalar_t, acc_t, 1>(a, 0.0, totals, mean.options(), grad_x.data_ptr<scalar_t>());
    }
  });
}

}  // namespace cuda
}  // namespace patchgemm
