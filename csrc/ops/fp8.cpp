// FP8 ops: quantization with current scaling, the grouped GEMM of FP8 operands that writes its
// output in the grouped-linear layout, and the ragged one. Autograd lives in Python
// (patchgemm/fp8.py), which quantizes each GEMM's operands in the layout that GEMM reads.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "ops/checks.h"
#include "ops/ragged_grouped_linear.h"
#include "problems/fp8.h"
#include "selection/fp8_tables.h"

namespace patchgemm {
namespace {

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

void check_fp8(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* expected) {
  check_dim(op, name, t, dim, expected);
  TORCH_CHECK(is_fp8(t.scalar_type()), op, ": ", name, " must be float8_e4m3fn or float8_e5m2, got ",
              t.scalar_type(), " (shape ", t.sizes(), ")");
}

void check_scale(const char* op, const char* name, const at::Tensor& scale, const at::Tensor& like) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, op, ": ", name,
              " must be one float32 value (a per-tensor scale), got ", scale.scalar_type(), " of shape ",
              scale.sizes());
  TORCH_CHECK(scale.device() == like.device(), op, ": ", name, " is on ", scale.device(), " but the operands are on ",
              like.device());
}

// The scales, out_dtype and bias [G, <n>] (of out_dtype) of an FP8 GEMM of a and b [G, <n>, K].
void check_scales_out_bias(const char* op, const at::Tensor& scale_a, const at::Tensor& scale_b,
                           const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, const at::Tensor& a,
                           const at::Tensor& b, const char* n) {
  check_scale(op, "scale_a", scale_a, a);
  check_scale(op, "scale_b", scale_b, a);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16, op,
              ": out_dtype must be float32, float16 or bfloat16, got ", out_dtype);
  if (!bias) return;
  const std::string layout = std::string("[G, ") + n + "]";
  check_dim(op, "bias", *bias, 2, layout.c_str());
  TORCH_CHECK(bias->size(0) == b.size(0) && bias->size(1) == b.size(1), op, ": bias must be ", layout, " = [",
              b.size(0), ", ", b.size(1), "], got ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == out_dtype && bias->device() == a.device(), op, ": bias must be ", out_dtype,
              " on ", a.device(), " (the output's dtype), got ", bias->scalar_type(), " on ", bias->device());
}

}  // namespace

QuantizeOutputs quantize_fp8(const at::Tensor& x, at::ScalarType format, bool rowwise, bool transposed,
                             bool column_sums, const std::optional<at::Tensor>& amax_state) {
  constexpr const char* op = "quantize_fp8";
  TORCH_CHECK(format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2, op,
              ": format must be torch.float8_e4m3fn or torch.float8_e5m2, got ", format);
  check_floating(op, "x", x);
  TORCH_CHECK(!transposed || x.dim() >= 2, op, ": a transposed copy needs x of 2 dims or more, got shape ", x.sizes());
  TORCH_CHECK(!column_sums || x.dim() >= 2, op, ": column sums need x of 2 dims or more, got shape ", x.sizes());
  TORCH_CHECK(rowwise || transposed, op, ": asked for neither data (rowwise) nor its transposed copy");
  if (amax_state) {
    const at::Tensor& state = *amax_state;
    TORCH_CHECK(state.dim() == 1 && state.scalar_type() == at::kFloat && state.is_contiguous() &&
                    state.numel() >= 3 && state.numel() <= kMaxAmaxHistory + 2,
                op, ": amax_state must be a contiguous float32 tensor [L + 2] with 1 <= L <= ", kMaxAmaxHistory,
                ", got ", state.scalar_type(), " of shape ", state.sizes());
    TORCH_CHECK(state.device() == x.device(), op, ": amax_state is on ", state.device(), " but x is on ", x.device());
  }
  return select_quantize_fp8(
      {x.contiguous(), format, rowwise, transposed, column_sums, amax_state.value_or(at::Tensor())});
}

at::Tensor scaled_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, bool group_major,
                             at::ScalarType out_dtype, bool fast_accum) {
  constexpr const char* op = "scaled_grouped_mm";
  const char* layout = group_major ? "[G, M, K]" : "[M, G, K]";
  check_fp8(op, "a", a, 3, layout);
  check_fp8(op, "b", b, 3, "[G, N, K]");
  const int64_t group_dim = group_major ? 0 : 1;
  TORCH_CHECK(a.size(group_dim) == b.size(0) && a.size(2) == b.size(2), op, ": a ", a.sizes(), " (layout ", layout,
              ") and b ", b.sizes(), " ([G, N, K]) must agree in G and K");
  TORCH_CHECK(a.device() == b.device(), op, ": a is on ", a.device(), " but b is on ", b.device());
  check_scales_out_bias(op, scale_a, scale_b, bias, out_dtype, a, b, "N");
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(1)}, a.options().dtype(out_dtype));
  const at::Tensor a_by_group = group_major ? a : a.transpose(0, 1);
  const at::Tensor c = group_major ? out : out.transpose(0, 1);
  return select_scaled_grouped_mm({a_by_group, b, scale_a.reshape({}), scale_b.reshape({}), bias, fast_accum, out, c});
}

at::Tensor scaled_ragged_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, const at::Tensor& offsets,
                            at::ScalarType out_dtype, bool fast_accum) {
  constexpr const char* op = "scaled_ragged_mm";
  check_fp8(op, "a", a, 2, "[N, K] (rows sorted by group)");
  check_fp8(op, "b", b, 3, "[G, Nc, K]");
  TORCH_CHECK(a.size(1) == b.size(2), op, ": a ", a.sizes(), " ([N, K]) and b ", b.sizes(),
              " ([G, Nc, K]) must agree in K");
  TORCH_CHECK(a.device() == b.device(), op, ": a is on ", a.device(), " but b is on ", b.device());
  check_scales_out_bias(op, scale_a, scale_b, bias, out_dtype, a, b, "Nc");
  check_offsets(op, offsets, a, "a", b.size(0), "b");
  return select_scaled_ragged_mm(
      {a.contiguous(), b.contiguous(), scale_a.reshape({}), scale_b.reshape({}), bias, offsets, out_dtype, fast_accum});
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("scaled_grouped_mm", &scaled_grouped_mm);
  m.impl("scaled_ragged_mm", &scaled_ragged_mm);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("scaled_grouped_mm", &scaled_grouped_mm);
  m.impl("scaled_ragged_mm", &scaled_ragged_mm);
}
#endif

}  // namespace patchgemm
