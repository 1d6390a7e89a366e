// The ragged grouped linear ops' C++ (ragged_grouped_linear.cpp), which the autograd layer
// (autograd.cpp) runs directly on plain calls.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace patchgemm {

at::Tensor ragged_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const at::Tensor& offsets);
at::Tensor ragged_grouped_linear_grad_input(const at::Tensor& grad_y, const at::Tensor& weight,
                                            const at::Tensor& offsets);
at::Tensor ragged_grouped_linear_grad_weight(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& offsets);

// Checks a ragged op's offsets: [groups] int32 / int64 (`groups_name`'s groups), on the CPU or on
// `rows`'s device (whose rows they split); CPU offsets' values too (GPU offsets: where read).
void check_offsets(const char* op, const at::Tensor& offsets, const at::Tensor& rows, const char* rows_name,
                   int64_t groups, const char* groups_name);

}  // namespace patchgemm
