// Current-scaling FP8 quantization in two kernels: amax(|x|), then the cast that reads it. Each
// thread moves 16 bytes of x at a time; the divisions round to nearest (--use_fast_math would
// otherwise approximate them), so the result is bitwise that of quantize_fp8_aten.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/quant/fp8.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// 16 bytes of x: 4 float32 or 8 16-bit values.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// The bits of |v|: non-negative floats order as their bit patterns, and a NaN (sign cleared) lies
// above +inf, so an integer max over them is amax with NaN propagated.
__device__ __forceinline__ unsigned int abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// amax_bits must hold 0 on entry; afterwards the bits of amax(|x|).
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, int64_t n,
                                                          unsigned int* __restrict__ amax_bits) {
  using P = Pack<T>;
  unsigned int local = 0;
  const int64_t packs = n / P::kSize, stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t i = first; i < packs; i += stride) {
    const P p = reinterpret_cast<const P*>(x)[i];
#pragma unroll
    for (int j = 0; j < P::kSize; ++j) local = max(local, abs_bits(static_cast<float>(p.v[j])));
  }
  for (int64_t i = packs * P::kSize + first; i < n; i += stride) local = max(local, abs_bits(static_cast<float>(x[i])));
  for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_xor_sync(0xffffffffu, local, offset));
  __shared__ unsigned int warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) local = max(local, warps[w]);
    atomicMax(amax_bits, local);
  }
}

// scale = amax / max (1 for amax 0; NaN and inf carried), data = saturate(x / scale). The scale
// goes to its own word: no block may overwrite amax's bits while another may still read them.
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads) cast_kernel(const T* __restrict__ x, int64_t n,
                                                          const unsigned int* __restrict__ amax_bits,
                                                          __nv_fp8_storage_t* __restrict__ data,
                                                          float* __restrict__ scale_out) {
  using P = Pack<T>;
  constexpr float kMax = kFormat == __NV_E4M3 ? 448.f : 57344.f;
  const float amax = __uint_as_float(*amax_bits);
  const float scale = amax == 0.f ? 1.f : __fdiv_rn(amax, kMax);
  const int64_t packs = n / P::kSize, stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (first == 0) *scale_out = scale;
  struct alignas(P::kSize) Out {
    __nv_fp8_storage_t v[P::kSize];
  };
  for (int64_t i = first; i < packs; i += stride) {
    const P p = reinterpret_cast<const P*>(x)[i];
    Out o;
#pragma unroll
    for (int j = 0; j < P::kSize; ++j) {
      o.v[j] = __nv_cvt_float_to_fp8(__fdiv_rn(static_cast<float>(p.v[j]), scale), __NV_SATFINITE, kFormat);
    }
    reinterpret_cast<Out*>(data)[i] = o;
  }
  for (int64_t i = packs * P::kSize + first; i < n; i += stride) {
    data[i] = __nv_cvt_float_to_fp8(__fdiv_rn(static_cast<float>(x[i]), scale), __NV_SATFINITE, kFormat);
  }
}

}  // namespace

void quantize_fp8(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale) {
  TORCH_INTERNAL_ASSERT(x.is_contiguous() && data.is_contiguous() && data.numel() == x.numel());
  TORCH_INTERNAL_ASSERT(scale.scalar_type() == at::kFloat && scale.numel() == 1);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  // amax's bits live beside the scale until the cast has read them (one allocation, one memset).
  const at::Tensor amax_bits = at::zeros({1}, x.options().dtype(at::kInt));
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t pack = 16 / x.element_size();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n / pack + kThreads - 1) / kThreads, 8 * sms));
  const bool e4m3 = data.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_INTERNAL_ASSERT(e4m3 || data.scalar_type() == at::kFloat8_e5m2);
  // Pack loads need x 16-byte aligned; the allocator's tensors are, offset views may not be.
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(data.const_data_ptr()) % 16 == 0);
  auto* bits = reinterpret_cast<unsigned int*>(amax_bits.mutable_data_ptr<int>());
  auto* out = reinterpret_cast<__nv_fp8_storage_t*>(data.mutable_data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_fp8", [&] {
    const auto* in = x.const_data_ptr<scalar_t>();
    if (n > 0) {
      amax_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, n, bits);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (e4m3) {
      cast_kernel<scalar_t, __NV_E4M3><<<blocks, kThreads, 0, stream>>>(in, n, bits, out, scale.mutable_data_ptr<float>());
    } else {
      cast_kernel<scalar_t, __NV_E5M2><<<blocks, kThreads, 0, stream>>>(in, n, bits, out, scale.mutable_data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace patchgemm
