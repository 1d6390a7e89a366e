// FP8 quantization with current scaling: one scale per tensor, computed from the tensor itself.
// data = saturate(x / scale) in an FP8 format, scale = amax(|x|) / max(format) (1 for an all-zero x),
// so x ~ scale * data; `scale` is what an FP8 GEMM multiplies its product by (cuBLASLt's A/B scale,
// torch._scaled_mm's scale_a/scale_b). A NaN in x makes amax NaN, an inf makes it inf: the scale
// then carries it into every product (never a finite answer from a non-finite input).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace patchgemm {

// The largest finite value of an FP8 format (e4m3fn: 448, e5m2: 57344).
double fp8_max(at::ScalarType format);

// ATen's reduction and elementwise ops (four passes over x): any device, the reference.
std::tuple<at::Tensor, at::Tensor> quantize_fp8_aten(const at::Tensor& x, at::ScalarType format);

#if defined(PATCHGEMM_WITH_CUDA) && !defined(USE_ROCM)
namespace cuda {
// Two kernels, no host sync (graph-safe): amax(|x|) into `scale`'s memory, then one pass that reads
// x, writes data and turns amax into the scale. x contiguous float32/float16/bfloat16, data
// contiguous of x's shape in e4m3fn or e5m2, scale a float32 scalar; all on one GPU.
void quantize_fp8(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale);
}  // namespace cuda
#endif

}  // namespace patchgemm
