// FP8 quantization through ATen's ops: the reference and the path where no fused kernel runs.
#include "kernels/quant/fp8.h"

namespace patchgemm {

double fp8_max(at::ScalarType format) {
  TORCH_CHECK(format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2,
              "patchgemm: FP8 formats are float8_e4m3fn and float8_e5m2, got ", format);
  return format == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
}

Quantized quantize_fp8_aten(const at::Tensor& x, at::ScalarType format, bool rowwise, bool transposed,
                            bool column_sums) {
  const double max = fp8_max(format);
  const at::Tensor xf = x.to(at::kFloat);
  // amax propagates NaN (max does; abs keeps it): an all-zero x gets scale 1.
  const at::Tensor amax = xf.numel() ? xf.abs().max() : at::zeros({}, xf.options());
  // A true division: ATen turns one by a number into a multiplication by its reciprocal on CUDA.
  const at::Tensor scale = at::where(amax == 0, at::ones_like(amax), amax / at::full({}, max, amax.options()));
  // x * (1 / scale), each step rounded (as the fused kernels compute it).
  const at::Tensor data = (xf * scale.reciprocal()).clamp(-max, max).to(format).contiguous();
  const at::Tensor none = at::empty({0}, data.options());
  return {rowwise ? data : none, transposed ? data.transpose(-2, -1).contiguous() : none, scale,
          column_sums ? x.sum(-2) : at::empty({0}, x.options())};
}

}  // namespace patchgemm
