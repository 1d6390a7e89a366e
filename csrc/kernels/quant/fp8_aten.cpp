// FP8 quantization through ATen's ops: the reference and the path where no fused kernel runs.
#include "kernels/quant/fp8.h"

namespace patchgemm {

double fp8_max(at::ScalarType format) {
  TORCH_CHECK(format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2,
              "patchgemm: FP8 formats are float8_e4m3fn and float8_e5m2, got ", format);
  return format == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
}

namespace {

// The history gains `observed` (newest first), the amax to scale from becomes its max (NaN
// propagated, as max does), and the observed word returns to 0.
void record_amax(const at::Tensor& state, const at::Tensor& observed) {
  const at::Tensor history = state.narrow(0, 2, state.numel() - 2);
  const at::Tensor shifted = at::cat({observed.reshape({1}), history.narrow(0, 0, history.numel() - 1)});
  history.copy_(shifted);
  state[0].copy_(shifted.max());
  state[1].zero_();
}

}  // namespace

Quantized quantize_fp8_aten(const at::Tensor& x, at::ScalarType format, bool rowwise, bool transposed,
                            bool column_sums, const at::Tensor& amax_state) {
  const double max = fp8_max(format);
  const at::Tensor xf = x.to(at::kFloat);
  // amax propagates NaN (max does; abs keeps it): an all-zero x gets scale 1.
  const at::Tensor observed = xf.numel() ? xf.abs().max() : at::zeros({}, xf.options());
  const bool delayed = amax_state.defined();
  // Delayed: the state's amax, or x's own while the state holds none (as the fused kernels read it).
  const at::Tensor amax = delayed ? at::where(amax_state[0] != 0, amax_state[0], observed) : observed;
  // A true division: ATen turns one by a number into a multiplication by its reciprocal on CUDA.
  const at::Tensor scale = at::where(amax == 0, at::ones_like(amax), amax / at::full({}, max, amax.options()));
  // x * (1 / scale), each step rounded (as the fused kernels compute it).
  const at::Tensor data = (xf * scale.reciprocal()).clamp(-max, max).to(format).contiguous();
  if (delayed) record_amax(amax_state, observed);
  const at::Tensor none = at::empty({0}, data.options());
  return {rowwise ? data : none, transposed ? data.transpose(-2, -1).contiguous() : none, scale,
          column_sums ? x.sum(-2) : at::empty({0}, x.options())};
}

}  // namespace patchgemm
