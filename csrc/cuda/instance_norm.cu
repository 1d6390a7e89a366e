// Fused instance norm + GELU (see instance_norm.h): four memory-bound kernels.
//
//   channel_sums  per (sample, channel) partial sums of two terms over a chunk of S: the forward
//                 sums x - k and (x - k)^2 (k = the channel's first element: a shift that keeps
//                 the variance free of cancellation), the backward dz and dz * xhat.
//   finish_sums   adds a channel's partials (in double) into mean/rstd, or s1/s2.
//   apply         one element-wise pass: y = act(z), or grad_x from dz and the sums.
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

#include "instance_norm.h"

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
  const acc_t* mean;       // [B * C]; backward and apply only
  const acc_t* rstd;
  const acc_t* s1;         // [B * C] sums of the backward; its apply only
  const acc_t* s2;
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
  xhat = (x - ch.shift_or_mean) * ch.rstd;
  dz = gelu ? dy * gelu_grad(xhat * ch.gamma + ch.beta) : dy;
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
    part1[bc * gridDim.y + blockIdx.y] = t1;
    part2[bc * gridDim.y + blockIdx.y] = t2;
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
      const int64_t bc = b * C + c0 + i;
      part1[bc * gridDim.x + blockIdx.x] = u1;
      part2[bc * gridDim.x + blockIdx.x] = u2;
    }
    __syncthreads();
  }
}

// One thread per (sample, channel): adds its chunks' partials. Stats: mean and rstd; backward:
// the sums themselves.
template <Pass kPass, typename scalar_t, typename acc_t>
__global__ void finish_sums(Args<scalar_t, acc_t> a, int64_t chunks, const acc_t* part1,
                            const acc_t* part2, double eps, acc_t* out1, acc_t* out2) {
  const int64_t bc = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bc >= a.shape.batch * a.shape.channels) return;
  double u1 = 0, u2 = 0;
  for (int64_t i = 0; i < chunks; ++i) {
    u1 += part1[bc * chunks + i];
    u2 += part2[bc * chunks + i];
  }
  if (kPass == Pass::kStats) {
    const double n = static_cast<double>(a.shape.spatial), d = u1 / n;
    const Channel<acc_t> ch = channel_of<kPass>(a, bc / a.shape.channels, bc % a.shape.channels);
    const double var = u2 / n - d * d;
    out1[bc] = static_cast<acc_t>(static_cast<double>(ch.shift_or_mean) + d);
    out2[bc] = static_cast<acc_t>(1.0 / sqrt((var > 0 ? var : 0.0) + eps));
  } else {
    out1[bc] = static_cast<acc_t>(u1);
    out2[bc] = static_cast<acc_t>(u2);
  }
}

// The element-wise pass over V-element vectors; a vector never straddles two channels
// (channels-first: S % V == 0) or two samples (tokens: C % V == 0). kStats here means the forward's
// output pass (after the statistics), kBackward the input gradient.
template <Pass kPass, typename scalar_t, typename acc_t, int V>
__global__ void __launch_bounds__(kThreads)
    apply(Args<scalar_t, acc_t> a, scalar_t* out) {
  const NormShape& s = a.shape;
  const int64_t vectors = s.numel() / V;
  const acc_t inv_n = acc_t(1) / static_cast<acc_t>(s.spatial);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = v * V;
    const int64_t b = e / (s.spatial * s.channels);
    const int64_t c_first = s.tokens ? e % s.channels : (e / s.spatial) % s.channels;
    const Vec<scalar_t, V> xv = load<scalar_t, V>(a.x + e);
    Vec<scalar_t, V> dv{}, result;
    if (kPass == Pass::kBackward) dv = load<scalar_t, V>(a.dy + e);
    // channels-first vectors lie in one channel: its parameters are loaded once.
    Channel<acc_t> ch = channel_of<Pass::kBackward>(a, b, c_first);
    acc_t mean_dz = 0, mean_dz_xhat = 0;
    if (kPass == Pass::kBackward) {
      mean_dz = a.s1[b * s.channels + c_first] * inv_n;
      mean_dz_xhat = a.s2[b * s.channels + c_first] * inv_n;
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (s.tokens && i > 0) {
        ch = channel_of<Pass::kBackward>(a, b, c_first + i);
        if (kPass == Pass::kBackward) {
          mean_dz = a.s1[b * s.channels + c_first + i] * inv_n;
          mean_dz_xhat = a.s2[b * s.channels + c_first + i] * inv_n;
        }
      }
      const acc_t x = static_cast<acc_t>(xv.v[i]);
      if (kPass == Pass::kStats) {
        const acc_t z = (x - ch.shift_or_mean) * ch.rstd * ch.gamma + ch.beta;
        result.v[i] = static_cast<scalar_t>(a.gelu ? gelu_of(z) : z);
      } else {
        acc_t dz, xhat;
        dz_xhat(x, static_cast<acc_t>(dv.v[i]), ch, a.gelu, dz, xhat);
        result.v[i] = static_cast<scalar_t>(ch.rstd * ch.gamma * (dz - mean_dz - xhat * mean_dz_xhat));
      }
    }
    *reinterpret_cast<Vec<scalar_t, V>*>(out + e) = result;
  }
}

bool aligned(const void* p, int64_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Both reductions: partial sums per chunk, then their totals into out1/out2 [B * C].
template <Pass kPass, typename scalar_t, typename acc_t, int V>
void channel_sums(const Args<scalar_t, acc_t>& a, double eps, acc_t* out1, acc_t* out2,
                  const at::TensorOptions& acc_options) {
  const NormShape& s = a.shape;
  auto stream = at::cuda::getCurrentCUDAStream();
  int64_t chunk, chunks;
  int cols = 0;
  dim3 grid;
  if (s.tokens) {
    const int64_t col_vectors = s.channels / V;
    cols = static_cast<int>(std::min<int64_t>(col_vectors, kThreads));
    const int64_t rows_per_pass = kThreads / cols;
    chunk = std::max<int64_t>(rows_per_pass, kChunkElements / s.channels);
    chunks = (s.spatial + chunk - 1) / chunk;
    if (chunks > kMaxChunks) {
      chunks = kMaxChunks;
      chunk = (s.spatial + chunks - 1) / chunks;
    }
    TORCH_CHECK(s.batch <= 65535, "instance_norm_act: batch ", s.batch, " exceeds 65535");
    grid = dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(s.batch),
                static_cast<unsigned>((col_vectors + cols - 1) / cols));
  } else {
    chunks = std::min<int64_t>((s.spatial + kChunkElements - 1) / kChunkElements, kMaxChunks);
    chunk = (s.spatial + chunks - 1) / chunks;
    chunk = (chunk + V - 1) / V * V;  // chunks start on vector boundaries
    grid = dim3(static_cast<unsigned>(s.batch * s.channels), static_cast<unsigned>(chunks));
  }
  at::Tensor part = at::empty({2, s.batch * s.channels * chunks}, acc_options);
  acc_t* p1 = part.data_ptr<acc_t>();
  acc_t* p2 = p1 + s.batch * s.channels * chunks;
  if (s.tokens) {
    channel_sums_tokens<kPass, scalar_t, acc_t, V><<<grid, kThreads, 0, stream>>>(a, chunk, cols, p1, p2);
  } else {
    channel_sums_cf<kPass, scalar_t, acc_t, V><<<grid, kThreads, 0, stream>>>(a, chunk, p1, p2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t bcs = s.batch * s.channels;
  finish_sums<kPass><<<static_cast<unsigned>((bcs + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a, chunks, p1, p2, eps, out1, out2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Pass kPass, typename scalar_t, typename acc_t, int V>
void launch_apply(const Args<scalar_t, acc_t>& a, scalar_t* out) {
  const int64_t vectors = a.shape.numel() / V;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads,
                                           at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 16);
  apply<kPass, scalar_t, acc_t, V><<<static_cast<unsigned>(blocks), kThreads, 0,
                                    at::cuda::getCurrentCUDAStream()>>>(a, out);
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
                            ptr_or_null<scalar_t>(bias), mean.data_ptr<acc_t>(),
                            rstd.data_ptr<acc_t>(), nullptr, nullptr, s, gelu};
    constexpr int V = 16 / sizeof(scalar_t);
    if (can_vectorize<scalar_t>(s, {x.const_data_ptr(), y.data_ptr()})) {
      channel_sums<Pass::kStats, scalar_t, acc_t, V>(a, eps, mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(), mean.options());
      launch_apply<Pass::kStats, scalar_t, acc_t, V>(a, y.data_ptr<scalar_t>());
    } else {
      channel_sums<Pass::kStats, scalar_t, acc_t, 1>(a, eps, mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(), mean.options());
      launch_apply<Pass::kStats, scalar_t, acc_t, 1>(a, y.data_ptr<scalar_t>());
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
                            mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(),
                            sum_dz.data_ptr<acc_t>(), sum_dz_xhat.data_ptr<acc_t>(), s, gelu};
    acc_t* s1 = sum_dz.data_ptr<acc_t>();
    acc_t* s2 = sum_dz_xhat.data_ptr<acc_t>();
    constexpr int V = 16 / sizeof(scalar_t);
    if (can_vectorize<scalar_t>(s, {x.const_data_ptr(), grad_y.const_data_ptr(), grad_x.data_ptr()})) {
      channel_sums<Pass::kBackward, scalar_t, acc_t, V>(a, 0.0, s1, s2, mean.options());
      launch_apply<Pass::kBackward, scalar_t, acc_t, V>(a, grad_x.data_ptr<scalar_t>());
    } else {
      channel_sums<Pass::kBackward, scalar_t, acc_t, 1>(a, 0.0, s1, s2, mean.options());
      launch_apply<Pass::kBackward, scalar_t, acc_t, 1>(a, grad_x.data_ptr<scalar_t>());
    }
  });
}

}  // namespace cuda
}  // namespace patchgemm
