// Fused instance norm + GELU (see instance_norm.h): four memory-bound kernels.
//
//   channel_sums  per (sample, channel) partial sums of two terms over a chunk of S: the forward
//                 sums x - k and (x - k)^2 (k = the channel's first element: a shift that keeps
//                 the variance free of cancellation), the backward dz and dz * xhat.
//   finish_sums   adds a channel's partials (in double) into mean/rstd, or s1/s2, and the
//                 coefficients of the element-wise pass.
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

// channels-first: block (chunk, b * C + c) sums its chunk of the channel's contiguous run.
template <Pass kPass, typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kThreads)
    channel_sums_cf(Args<scalar_t, acc_t> a, int64_t chunk, acc_t* part1, acc_t* part2) {
  const int64_t bc = blockIdx.x, S = a.shape.spatial;
  const Channel<acc_t> ch = channel_of<kPass>(a, bc / a.shape.channels, bc % a.shape.channels);
  const int64_t begin = blockIdx.y * chunk, end = imin(S, begin + chunk);
  acc_t t1 = 0, t2 = 0;
  for (int64_t s = begin + threadIdx.x * V; s < end; s += kThreads * V) {
    const Vec<scalar_t, V> xv = load<scalar_t, V>(a.x + bc * S + s);
    Vec<scalar_t, V> dv{};
    if (kPass == Pass::kBackward) dv = load<scalar_t, V>(a.dy + bc * S + s);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      add_terms<kPass>(static_cast<acc_t>(xv.v[i]), static_cast<acc_t>(dv.v[i]), ch, a.gelu, t1, t2);
    }
  }
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
    for (int64_t s = begin + ty; s < end; s += rows_per_pass) {
      const int64_t off = (b * S + s) * C + c0;
      const Vec<scalar_t, V> xv = load<scalar_t, V>(a.x + off);
      Vec<scalar_t, V> dv{};
      if (kPass == Pass::kBackward) dv = load<scalar_t, V>(a.dy + off);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        add_terms<kPass>(static_cast<acc_t>(xv.v[i]), static_cast<acc_t>(dv.v[i]), ch[i], a.gelu,
                         t1[i], t2[i]);
      }
    }
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

// One thread per (sample, channel): adds its chunks' partials ([chunk][b * C + c], so a warp
// reads them coalesced) and writes the coefficients of the element-wise pass, coef[j][b * C + c]:
//   both:     mean, ca = rstd * gamma, beta; z = (x - mean) * ca + beta, y = act(z)
//   backward: m1 = mean(dz), m2r = mean(dz * xhat) * rstd over the channel;
//             dx = rstd * gamma * (dz - m1 - xhat * m2) = ca * (dz - m1 - (x - mean) * m2r)
// (x - mean is formed first, as PyTorch does: no cancellation between large terms). Also the
// statistics (mean, rstd) or the sums (s1, s2, for dweight / dbias) into out1 / out2.
template <Pass kPass, typename scalar_t, typename acc_t>
__global__ void finish_sums(Args<scalar_t, acc_t> a, int64_t chunks, const acc_t* part1,
                            const acc_t* part2, double eps, acc_t* out1, acc_t* out2,
                            acc_t* coef) {
  const int64_t bcs = a.shape.batch * a.shape.channels;
  const int64_t bc = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bc >= bcs) return;
  double u1 = 0, u2 = 0;
  for (int64_t i = 0; i < chunks; ++i) {
    u1 += part1[i * bcs + bc];
    u2 += part2[i * bcs + bc];
  }
  const double n = static_cast<double>(a.shape.spatial);
  const Channel<acc_t> ch = channel_of<kPass>(a, bc / a.shape.channels, bc % a.shape.channels);
  double mean, rstd;
  if (kPass == Pass::kStats) {
    const double d = u1 / n, var = u2 / n - d * d;
    mean = static_cast<double>(ch.shift_or_mean) + d;
    rstd = 1.0 / sqrt((var > 0 ? var : 0.0) + eps);
    out1[bc] = static_cast<acc_t>(mean);
    out2[bc] = static_cast<acc_t>(rstd);
  } else {
    mean = ch.shift_or_mean;
    rstd = ch.rstd;
    out1[bc] = static_cast<acc_t>(u1);
    out2[bc] = static_cast<acc_t>(u2);
  }
  const int64_t c = bc % a.shape.channels;
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

// Both reductions: partial sums per chunk, then per (sample, channel) their totals into out1 /
// out2 [B * C] and the element-wise pass's coefficients into coef.
template <Pass kPass, typename scalar_t, typename acc_t, int V>
void channel_sums(const Args<scalar_t, acc_t>& a, double eps, acc_t* out1, acc_t* out2,
                  acc_t* coef, const at::TensorOptions& acc_options) {
  const NormShape& s = a.shape;
  auto stream = at::cuda::getCurrentCUDAStream();
  // Enough blocks to fill the GPU several times over, each with a long run of rows to stream.
  const int64_t target_blocks = 16LL * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunk, chunks;
  int cols = 0;
  dim3 grid;
  if (s.tokens) {
    const int64_t col_vectors = s.channels / V;
    cols = static_cast<int>(std::min<int64_t>(col_vectors, kThreads));
    const int64_t tiles = (col_vectors + cols - 1) / cols, rows_per_pass = kThreads / cols;
    chunks = std::max<int64_t>(1, target_blocks / std::max<int64_t>(1, s.batch * tiles));
    chunks = std::min({chunks, (s.spatial + rows_per_pass - 1) / rows_per_pass, kMaxChunks});
    chunk = (s.spatial + chunks - 1) / chunks;
    chunks = (s.spatial + chunk - 1) / chunk;
    TORCH_CHECK(s.batch <= 65535 && tiles <= 65535, "instance_norm_act: batch ", s.batch,
                " or channels ", s.channels, " too large for the CUDA kernels");
    grid = dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(s.batch),
                static_cast<unsigned>(tiles));
  } else {
    chunks = std::min<int64_t>((s.spatial + kChunkElements - 1) / kChunkElements, kMaxChunks);
    chunk = (s.spatial + chunks - 1) / chunks;
    chunk = (chunk + V - 1) / V * V;  // chunks start on vector boundaries
    grid = dim3(static_cast<unsigned>(s.batch * s.channels), static_cast<unsigned>(chunks));
  }
  const int64_t bcs = s.batch * s.channels;
  at::Tensor part = at::empty({2, bcs * chunks}, acc_options);
  acc_t* p1 = part.data_ptr<acc_t>();
  acc_t* p2 = p1 + bcs * chunks;
  if (s.tokens) {
    channel_sums_tokens<kPass, scalar_t, acc_t, V><<<grid, kThreads, 0, stream>>>(a, chunk, cols, p1, p2);
  } else {
    channel_sums_cf<kPass, scalar_t, acc_t, V><<<grid, kThreads, 0, stream>>>(a, chunk, p1, p2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  finish_sums<kPass><<<static_cast<unsigned>((bcs + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a, chunks, p1, p2, eps, out1, out2, coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Pass kPass, typename scalar_t, typename acc_t, int V>
void launch_apply(const Args<scalar_t, acc_t>& a, const acc_t* coef, scalar_t* out) {
  const int64_t vectors = a.shape.numel() / V;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads,
                                           at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 16);
  apply<kPass, scalar_t, acc_t, V><<<static_cast<unsigned>(blocks), kThreads, 0,
                                    at::cuda::getCurrentCUDAStream()>>>(a, coef, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Both passes of one direction at vector width V.
template <Pass kPass, typename scalar_t, typename acc_t, int V>
void run(const Args<scalar_t, acc_t>& a, double eps, acc_t* out1, acc_t* out2,
         const at::TensorOptions& acc_options, scalar_t* out) {
  const int64_t bcs = a.shape.batch * a.shape.channels;
  at::Tensor coef = at::empty({kPass == Pass::kStats ? 3 : 5, bcs}, acc_options);
  channel_sums<kPass, scalar_t, acc_t, V>(a, eps, out1, out2, coef.data_ptr<acc_t>(), acc_options);
  launch_apply<kPass, scalar_t, acc_t, V>(a, coef.data_ptr<acc_t>(), out);
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
    acc_t* m = mean.data_ptr<acc_t>();
    acc_t* r = rstd.data_ptr<acc_t>();
    if (can_vectorize<scalar_t>(s, {x.const_data_ptr(), y.data_ptr()})) {
      run<Pass::kStats, scalar_t, acc_t, V>(a, eps, m, r, mean.options(), y.data_ptr<scalar_t>());
    } else {
      run<Pass::kStats, scalar_t, acc_t, 1>(a, eps, m, r, mean.options(), y.data_ptr<scalar_t>());
    }
  });
}

void instance_norm_act_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& mean, const at::Tensor& rstd, bool gelu,
                                const NormShape& s, const at::Tensor& grad_x,
                                const at::Tensor& sum_dz, const at::Tensor& sum_dz_xhat) {
  if (s.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "instance_norm_act_backward", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    Args<scalar_t, acc_t> a{x.const_data_ptr<scalar_t>(), grad_y.const_data_ptr<scalar_t>(),
                            ptr_or_null<scalar_t>(weight), ptr_or_null<scalar_t>(bias),
                            mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(), s, gelu};
    acc_t* s1 = sum_dz.data_ptr<acc_t>();
    acc_t* s2 = sum_dz_xhat.data_ptr<acc_t>();
    constexpr int V = 16 / sizeof(scalar_t);
    if (can_vectorize<scalar_t>(s, {x.const_data_ptr(), grad_y.const_data_ptr(), grad_x.data_ptr()})) {
      run<Pass::kBackward, scalar_t, acc_t, V>(a, 0.0, s1, s2, mean.options(), grad_x.data_ptr<scalar_t>());
    } else {
      run<Pass::kBackward, scalar_t, acc_t, 1>(a, 0.0, s1, s2, mean.options(), grad_x.data_ptr<scalar_t>());
    }
  });
}

}  // namespace cuda
}  // namespace patchgemm
