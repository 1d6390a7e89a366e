// SwiGLU on the GPU (swiglu.h): one memory-bound elementwise kernel each way. A thread handles one
// 16-byte vector of a row's gate and the matching vector of its up (H a multiple of the vector and
// the pointers aligned; else single elements), in a grid-stride loop.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "kernels/swiglu/swiglu.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

__device__ __forceinline__ float sigmoid_of(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ double sigmoid_of(double x) { return 1.0 / (1.0 + exp(-x)); }

// `hidden` and `total` count vectors of V elements: total = rows * hidden.
template <typename scalar_t, int V>
__global__ void swiglu_forward_kernel(const scalar_t* __restrict__ gate_up, scalar_t* __restrict__ h,
                                      int64_t hidden, int64_t total) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vector = Vec<scalar_t, V>;
  const auto* in = reinterpret_cast<const Vector*>(gate_up);
  auto* out = reinterpret_cast<Vector*>(h);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / hidden, col = i - row * hidden;
    const Vector gate = in[row * 2 * hidden + col], up = in[row * 2 * hidden + hidden + col];
    Vector y;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const acc_t g = static_cast<acc_t>(gate.v[k]);
      y.v[k] = static_cast<scalar_t>(g * sigmoid_of(g) * static_cast<acc_t>(up.v[k]));
    }
    out[i] = y;
  }
}

template <typename scalar_t, int V>
__global__ void swiglu_backward_kernel(const scalar_t* __restrict__ grad_h, const scalar_t* __restrict__ gate_up,
                                       scalar_t* __restrict__ grad_gate_up, int64_t hidden, int64_t total) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vector = Vec<scalar_t, V>;
  const auto* dh = reinterpret_cast<const Vector*>(grad_h);
  const auto* in = reinterpret_cast<const Vector*>(gate_up);
  auto* out = reinterpret_cast<Vector*>(grad_gate_up);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / hidden, col = i - row * hidden;
    const int64_t gate_at = row * 2 * hidden + col, up_at = gate_at + hidden;
    const Vector gate = in[gate_at], up = in[up_at], d = dh[i];
    Vector d_gate, d_up;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const acc_t g = static_cast<acc_t>(gate.v[k]), u = static_cast<acc_t>(up.v[k]);
      const acc_t dy = static_cast<acc_t>(d.v[k]), s = sigmoid_of(g);
      d_gate.v[k] = static_cast<scalar_t>(dy * u * s * (acc_t(1) + g * (acc_t(1) - s)));
      d_up.v[k] = static_cast<scalar_t>(dy * g * s);
    }
    out[gate_at] = d_gate;
    out[up_at] = d_up;
  }
}

// Blocks for `total` vector-threads: enough to fill the GPU several times over, then grid-stride.
unsigned blocks_for(int64_t total) {
  const int64_t max_blocks = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, max_blocks)));
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

template <typename scalar_t, int V>
void launch_forward(const at::Tensor& gate_up, const at::Tensor& h) {
  const int64_t total = h.numel() / V;
  swiglu_forward_kernel<scalar_t, V><<<blocks_for(total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      gate_up.const_data_ptr<scalar_t>(), h.mutable_data_ptr<scalar_t>(), h.size(-1) / V, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V>
void launch_backward(const at::Tensor& grad_h, const at::Tensor& gate_up, const at::Tensor& grad_gate_up) {
  const int64_t total = grad_h.numel() / V;
  swiglu_backward_kernel<scalar_t, V><<<blocks_for(total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      grad_h.const_data_ptr<scalar_t>(), gate_up.const_data_ptr<scalar_t>(),
      grad_gate_up.mutable_data_ptr<scalar_t>(), grad_h.size(-1) / V, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The widest vector (16 bytes) where the hidden size and every pointer allow it.
template <typename scalar_t>
bool use_vectors(int64_t hidden, std::initializer_list<const at::Tensor*> tensors) {
  bool aligned = hidden % (16 / sizeof(scalar_t)) == 0;
  for (const at::Tensor* t : tensors) aligned = aligned && aligned16(*t);
  return aligned;
}

}  // namespace

void swiglu_into(const at::Tensor& gate_up, const at::Tensor& h) {
  if (h.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "swiglu", [&] {
    if (use_vectors<scalar_t>(h.size(-1), {&gate_up, &h})) {
      launch_forward<scalar_t, 16 / sizeof(scalar_t)>(gate_up, h);
    } else {
      launch_forward<scalar_t, 1>(gate_up, h);
    }
  });
}

void swiglu_backward_into(const at::Tensor& grad_h, const at::Tensor& gate_up, const at::Tensor& grad_gate_up) {
  if (grad_h.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "swiglu_backward", [&] {
    if (use_vectors<scalar_t>(grad_h.size(-1), {&grad_h, &gate_up, &grad_gate_up})) {
      launch_backward<scalar_t, 16 / sizeof(scalar_t)>(grad_h, gate_up, grad_gate_up);
    } else {
      launch_backward<scalar_t, 1>(grad_h, gate_up, grad_gate_up);
    }
  });
}

}  // namespace cuda
}  // namespace patchgemm
