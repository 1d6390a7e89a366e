// Ragged grouped linear: x [N, Din] sorted by group, group g its rows offsets[g-1] .. offsets[g]
// (offsets [G]: cumulative sizes, int32 or int64, on the CPU or x's device; sizes may be 0), and
// y_g = x_g @ weight[g].T + bias[g] -- the expert layers of a mixture of experts. Validation here,
// once; the tables in selection/ragged_tables.cpp run the GEMMs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "ops/ragged_grouped_linear.h"
#include "selection/ragged_tables.h"

namespace patchgemm {
namespace {

void check_weight(const char* op, const at::Tensor& weight) {
  check_dim(op, "weight", weight, 3, "[G, Dout, Din]");
  check_floating(op, "weight", weight);
}

void check_rows(const char* op, const char* name, const at::Tensor& t, const at::Tensor& weight, int64_t feature_dim) {
  check_dim(op, name, t, 2, "[N, features] (rows sorted by group)");
  check_floating(op, name, t);
  check_like(op, name, t, "weight", weight);
  TORCH_CHECK(t.size(1) == weight.size(feature_dim), op, ": ", name, " has ", t.size(1), " features (shape ",
              t.sizes(), ") but weight [G, Dout, Din] ", weight.sizes(), " expects ", weight.size(feature_dim));
}

}  // namespace

void check_offsets(const char* op, const at::Tensor& offsets, const at::Tensor& rows, const char* rows_name,
                   int64_t groups, const char* groups_name) {
  check_dim(op, "offsets", offsets, 1, "[G] (cumulative group sizes)");
  TORCH_CHECK(offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong, op,
              ": offsets must be int32 or int64, got ", offsets.scalar_type());
  TORCH_CHECK(offsets.size(0) == groups, op, ": offsets has ", offsets.size(0), " entries but ", groups_name, " has ",
              groups, " groups");
  TORCH_CHECK(offsets.is_cpu() || offsets.device() == rows.device(), op, ": offsets must be on the CPU or on ",
              rows_name, "'s device (", rows.device(), "), got ", offsets.device());
  if (offsets.is_cpu()) ragged_bounds(op, offsets, rows.size(0));  // free here; GPU offsets: where read
  TORCH_CHECK(groups > 0 || rows.size(0) == 0, op, ": no groups, but ", rows_name, " has ", rows.size(0), " rows");
}

at::Tensor ragged_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const at::Tensor& offsets) {
  constexpr const char* op = "ragged_grouped_linear";
  check_weight(op, weight);
  check_rows(op, "x", x, weight, 2);
  check_offsets(op, offsets, x, "x", weight.size(0), "weight");
  if (bias) {
    check_dim(op, "bias", *bias, 2, "[G, Dout]");
    TORCH_CHECK(bias->size(0) == weight.size(0) && bias->size(1) == weight.size(1), op, ": bias must be [G, Dout] = [",
                weight.size(0), ", ", weight.size(1), "] to match weight ", weight.sizes(), ", got ", bias->sizes());
    check_like(op, "bias", *bias, "weight", weight);
  }
  // y_g = x_g @ weight[g]^T
  return select_ragged_gemm({op, false, x.contiguous(), weight.transpose(1, 2), bias, offsets, weight.size(0)});
}

at::Tensor ragged_grouped_linear_grad_input(const at::Tensor& grad_y, const at::Tensor& weight,
                                            const at::Tensor& offsets) {
  constexpr const char* op = "ragged_grouped_linear_grad_input";
  check_weight(op, weight);
  check_rows(op, "grad_y", grad_y, weight, 1);
  check_offsets(op, offsets, grad_y, "grad_y", weight.size(0), "weight");
  // grad_x_g = grad_y_g @ weight[g]
  return select_ragged_gemm({op, false, grad_y.contiguous(), weight, std::nullopt, offsets, weight.size(0)});
}

at::Tensor ragged_grouped_linear_grad_weight(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& offsets) {
  constexpr const char* op = "ragged_grouped_linear_grad_weight";
  check_dim(op, "grad_y", grad_y, 2, "[N, Dout]");
  check_dim(op, "x", x, 2, "[N, Din]");
  check_floating(op, "x", x);
  check_like(op, "grad_y", grad_y, "x", x);
  TORCH_CHECK(grad_y.size(0) == x.size(0), op, ": grad_y ", grad_y.sizes(), " and x ", x.sizes(),
              " must have the same rows");
  check_offsets(op, offsets, x, "x", offsets.dim() == 1 ? offsets.size(0) : 0, "weight");
  // grad_w[g] = grad_y_g^T @ x_g: the reduction runs over the group's rows.
  return select_ragged_gemm(
      {op, true, grad_y.contiguous().t(), x.contiguous(), std::nullopt, offsets, offsets.size(0)});
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("ragged_grouped_linear", &ragged_grouped_linear);
  m.impl("ragged_grouped_linear_grad_input", &ragged_grouped_linear_grad_input);
  m.impl("ragged_grouped_linear_grad_weight", &ragged_grouped_linear_grad_weight);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("ragged_grouped_linear", &ragged_grouped_linear);
  m.impl("ragged_grouped_linear_grad_input", &ragged_grouped_linear_grad_input);
  m.impl("ragged_grouped_linear_grad_weight", &ragged_grouped_linear_grad_weight);
}
#endif

}  // namespace patchgemm
