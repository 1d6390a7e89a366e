// FP8 quantization with one scale per tensor. data = saturate(x * (1 / scale)) in an FP8 format,
// scale = amax / max(format) (1 for amax 0), so x ~ scale * data. Current scaling takes amax(|x|)
// from x itself (a pass of its own); delayed scaling takes the largest amax of earlier calls, kept
// in an amax state (problems/fp8.h), and records x's own amax there from the cast's pass. `scale`
// is what an FP8 GEMM multiplies its product by (cuBLASLt's A/B scale, torch._scaled_mm's
// scale_a/scale_b). A NaN in x makes amax NaN, an inf makes it inf: the scale then carries it into
// every product (never a finite answer from a non-finite input).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "problems/fp8.h"

namespace patchgemm {

// The largest finite value of an FP8 format (e4m3fn: 448, e5m2: 57344).
double fp8_max(at::ScalarType format);

// What quantize_fp8 returns: data (x's shape, contiguous) where `rowwise`, data_t (x with its last
// two dims swapped, contiguous: the K-major copy a GEMM over the other dim reads) where
// `transposed`, sums (x summed over its second-to-last dim, in x's dtype, accumulated in fp32) where
// `column_sums`, each else an empty tensor; and the scale.
struct Quantized {
  at::Tensor data, data_t, scale, sums;
};

// ATen's reduction and elementwise ops (four passes over x, a copy for data_t): any device, the reference.
// `amax_state` (undefined: current scaling) is updated in place.
Quantized quantize_fp8_aten(const at::Tensor& x, at::ScalarType format, bool rowwise, bool transposed,
                            bool column_sums, const at::Tensor& amax_state);

#if defined(PATCHGEMM_WITH_CUDA) && !defined(USE_ROCM)
namespace cuda {
// No host sync (graph-safe). Current scaling (`amax_state` undefined): amax(|x|), then one pass that
// reads x, writes data and/or data_t (either may be undefined, not both) and the scale. Delayed:
// that pass alone, observing x's amax (amax(|x|) first only while the state holds no amax), then a
// one-block kernel records it in amax_state. x contiguous float32/float16/bfloat16
// and 16-byte aligned, data / data_t contiguous in e4m3fn or e5m2, scale a float32 scalar; one GPU.
// `sums` (undefined: not asked), contiguous in x's dtype: x summed over its second-to-last dim, in
// the transposing pass (each block's rows summed in fp32, then the blocks' sums; deterministic), or
// by ATen where no transposed copy is asked.
void quantize_fp8_into(const at::Tensor& x, const at::Tensor& data, const at::Tensor& data_t, const at::Tensor& scale,
                       const at::Tensor& sums, const at::Tensor& amax_state);
}  // namespace cuda
#endif

}  // namespace patchgemm
