// Ragged grouped linear's problems (groups of different row counts, x sorted by group), as the ops
// (ops/ragged_grouped_linear.cpp) build them after validation and the tables
// (selection/ragged_tables.cpp) run them. `offsets` [G] holds each group's end row (cumulative
// sizes; group g is rows offsets[g-1] .. offsets[g]), int32 or int64, on the CPU or x's device.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace patchgemm {

struct RaggedProblem {
  const char* op = "";
  // false: a's rows are split into the groups, out_g = a_g @ b[g] (+ bias[g]):
  //          a [N, K], b [G, K, Nc], bias [G, Nc], out [N, Nc];
  // true:  the reduction is split, out[g] = a[:, group g] @ b[group g rows]:
  //          a [M, N], b [N, Nc], out [G, M, Nc] (zeros for an empty group).
  bool ragged_k = false;
  at::Tensor a, b;
  std::optional<at::Tensor> bias;
  at::Tensor offsets;
  int64_t groups = 0;
};

at::Tensor select_ragged_gemm(const RaggedProblem& p);

// The groups' row bounds [0, offsets[0], ..., offsets[G-1]], read on the host (a sync for GPU
// offsets) and checked: non-decreasing from 0, ending at `rows`. The op checks CPU offsets with it,
// the candidates that need the sizes on the host read GPU offsets with it
// (ops/ragged_grouped_linear.cpp).
std::vector<int64_t> ragged_bounds(const char* op, const at::Tensor& offsets, int64_t rows);

// Each group's sizes on `device` ([G], int64), from offsets anywhere, without a host sync.
at::Tensor ragged_sizes(const at::Tensor& offsets, at::Device device);

// The ops' C++ (ops/ragged_grouped_linear.cpp), which the autograd layer runs directly on plain calls.
at::Tensor ragged_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const at::Tensor& offsets);
at::Tensor ragged_grouped_linear_grad_input(const at::Tensor& grad_y, const at::Tensor& weight, const at::Tensor& offsets);
at::Tensor ragged_grouped_linear_grad_weight(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& offsets);

}  // namespace patchgemm
