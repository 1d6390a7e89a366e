// SwiGLU on the CPU (swiglu.h): one parallel pass over rows. Each row is converted to float in blocks
// the L1 holds, the math runs on the blocks in loops the compiler vectorizes (an exp of our own: no
// calls, no branches), and the results are converted back. On x86-64 the block loops are compiled for
// AVX-512, AVX2 and the baseline, the best the machine runs chosen at load (GCC/Clang target_clones);
// the build itself stays portable. float64 runs a plain loop in float64.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/swiglu/swiglu.h"

// exp_float rounds by adding and subtracting 1.5 * 2^23, which reassociating float math would fold.
#ifdef __FAST_MATH__
#error "csrc/kernels/swiglu/swiglu_cpu.cpp needs IEEE float semantics: build without -ffast-math"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(_WIN32)
#define PATCHGEMM_ISA_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PATCHGEMM_ISA_CLONES
#endif

namespace patchgemm {
namespace {

constexpr int64_t kBlock = 512;  // values per block: a few blocks of floats stay in the L1

// e^x in float, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial, 2^n as two factors built in the exponent bits (n in [-150, 150]: denormals, and inf above
// 88.7, come out of the last product). NaN stays NaN. No branches, so a loop of it vectorizes.
inline float exp_float(float x) {
  const float clamped = x < -104.0f ? -104.0f : x > 104.0f ? 104.0f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float rounded = (clamped * 1.44269504088896341f + kRound) - kRound;
  const float n = rounded == rounded ? rounded : 0.0f;  // (NaN: p below is NaN already)
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts, the first exact
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t n_int = static_cast<int32_t>(n), half = n_int >> 1;
  const uint32_t bits_a = static_cast<uint32_t>(half + 127) << 23;
  const uint32_t bits_b = static_cast<uint32_t>(n_int - half + 127) << 23;
  float a, b;
  std::memcpy(&a, &bits_a, sizeof(a));
  std::memcpy(&b, &bits_b, sizeof(b));
  return p * a * b;
}

// h = silu(gate) * up = gate * up / (1 + e^-gate) over one block (e^-gate = inf: -0, as ATen's silu).
PATCHGEMM_ISA_CLONES void swiglu_block(const float* __restrict gate, const float* __restrict up, float* __restrict h,
                                       int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = gate[i] * up[i] / (1.0f + exp_float(-gate[i]));
}

// d_gate = dh * up * s * (1 + gate * (1 - s)), d_up = dh * gate * s, s = sigmoid(gate), over one block.
PATCHGEMM_ISA_CLONES void swiglu_backward_block(const float* __restrict dh, const float* __restrict gate,
                                                const float* __restrict up, float* __restrict d_gate,
                                                float* __restrict d_up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], s = 1.0f / (1.0f + exp_float(-g));
    d_gate[i] = dh[i] * up[i] * s * (1.0f + g * (1.0f - s));
    d_up[i] = dh[i] * g * s;
  }
}

// 16-bit <-> float conversions of one block, in loops the clones vectorize too.
PATCHGEMM_ISA_CLONES void widen(const c10::BFloat16* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
PATCHGEMM_ISA_CLONES void widen(const c10::Half* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
PATCHGEMM_ISA_CLONES void narrow(const float* in, c10::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<c10::BFloat16>(in[i]);
}
PATCHGEMM_ISA_CLONES void narrow(const float* in, c10::Half* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<c10::Half>(in[i]);
}

// A float block is read in place and written in place; 16-bit blocks go through float buffers.
template <typename T>
const float* as_float(const T* in, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return in;
  } else {
    widen(in, buffer, n);
    return buffer;
  }
}

template <typename T>
float* float_out(T* out, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return out;
  } else {
    return buffer;
  }
}

template <typename T>
void store(const float* result, T* out, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) narrow(result, out, n);
}

// Rows per task: enough values that a task outweighs its scheduling.
int64_t grain(int64_t hidden) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)); }

template <typename T>
void forward_rows(const T* in, T* out, int64_t hidden, int64_t begin, int64_t end) {
  alignas(64) float gate_buf[kBlock], up_buf[kBlock], h_buf[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = in + r * 2 * hidden;
    const T* up = gate + hidden;
    T* h = out + r * hidden;
    for (int64_t i = 0; i < hidden; i += kBlock) {
      const int64_t n = std::min(kBlock, hidden - i);
      float* result = float_out(h + i, h_buf);
      swiglu_block(as_float(gate + i, gate_buf, n), as_float(up + i, up_buf, n), result, n);
      store(result, h + i, n);
    }
  }
}

template <typename T>
void backward_rows(const T* grad_h, const T* in, T* out, int64_t hidden, int64_t begin, int64_t end) {
  alignas(64) float dh_buf[kBlock], gate_buf[kBlock], up_buf[kBlock], d_gate_buf[kBlock], d_up_buf[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const T* dh = grad_h + r * hidden;
    const T* gate = in + r * 2 * hidden;
    const T* up = gate + hidden;
    T* d_gate = out + r * 2 * hidden;
    T* d_up = d_gate + hidden;
    for (int64_t i = 0; i < hidden; i += kBlock) {
      const int64_t n = std::min(kBlock, hidden - i);
      float* d_gate_f = float_out(d_gate + i, d_gate_buf);
      float* d_up_f = float_out(d_up + i, d_up_buf);
      swiglu_backward_block(as_float(dh + i, dh_buf, n), as_float(gate + i, gate_buf, n),
                            as_float(up + i, up_buf, n), d_gate_f, d_up_f, n);
      store(d_gate_f, d_gate + i, n);
      store(d_up_f, d_up + i, n);
    }
  }
}

void forward_rows(const double* in, double* out, int64_t hidden, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const double* gate = in + r * 2 * hidden;
    const double* up = gate + hidden;
    for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
  }
}

void backward_rows(const double* grad_h, const double* in, double* out, int64_t hidden, int64_t begin,
                   int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const double* gate = in + r * 2 * hidden;
    const double* up = gate + hidden;
    double* d_gate = out + r * 2 * hidden;
    double* d_up = d_gate + hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const double g = gate[i], d = grad_h[r * hidden + i], s = 1.0 / (1.0 + std::exp(-g));
      d_gate[i] = d * up[i] * s * (1.0 + g * (1.0 - s));
      d_up[i] = d * g * s;
    }
  }
}

}  // namespace

bool swiglu_cpu_is_vectorized() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(_WIN32)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;  // aarch64: NEON is the baseline the loops vectorize for
#endif
}

void swiglu_cpu(const at::Tensor& gate_up, const at::Tensor& h) {
  const int64_t hidden = h.size(-1), rows = hidden ? h.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "swiglu", [&] {
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    scalar_t* out = h.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(hidden),
                     [&](int64_t begin, int64_t end) { forward_rows(in, out, hidden, begin, end); });
  });
}

void swiglu_backward_cpu(const at::Tensor& grad_h, const at::Tensor& gate_up, const at::Tensor& grad_gate_up) {
  const int64_t hidden = grad_h.size(-1), rows = hidden ? grad_h.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "swiglu_backward", [&] {
    const scalar_t* dh = grad_h.const_data_ptr<scalar_t>();
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    scalar_t* out = grad_gate_up.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(hidden),
                     [&](int64_t begin, int64_t end) { backward_rows(dh, in, out, hidden, begin, end); });
  });
}

}  // namespace patchgemm
