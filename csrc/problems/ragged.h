// Ragged grouped linear's problems (groups of different row counts, x sorted by group), as the ops
// (ops/ragged_grouped_linear.cpp) build them after validation and the tables
// (selection/ragged_tables.cpp) run them. `offsets` [G] holds each group's end row (cumulative
// sizes; group g is rows offsets[g-1] .. offsets[g]), int32 or int64, on the CPU or x's device.
#pragma once

#include <ATen/ATen.h>

#include <optional>

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
  at::Device device() const { return a.device(); }  // where it runs (choices are kept per device)
};

}  // namespace patchgemm
