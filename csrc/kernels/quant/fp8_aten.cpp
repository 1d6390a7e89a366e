// FP8 quantization through ATen's ops: the reference and the path where no fused kernel runs.
#include "kernels/quant/fp8.h"

#include <limits>

namespace patchgemm {

double fp8_max(at::ScalarType format) {
  TORCH_CHECK(format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2,
              "patchgemm: FP8 formats are float8_e4m3fn and float8_e5m2, got ", format);
  return format == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_aten(const at::Tensor& x, at::ScalarType format) {
  const double max = fp8_max(format);
  const at::Tensor xf = x.to(at::kFloat);
  // amax propagates NaN (max does; abs keeps it): an all-zero x gets scale 1.
  const at::Tensor amax = xf.numel() ? xf.abs().max() : at::zeros({}, xf.options());
  const at::Tensor scale = at::where(amax == 0, at::ones_like(amax), amax / max);
  const at::Tensor data = (xf / scale).clamp(-max, max).to(format);
  return {data.contiguous(), scale};
}

}  // namespace patchgemm
