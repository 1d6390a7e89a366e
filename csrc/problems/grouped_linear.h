// The grouped-linear ops' problems, as the ops (grouped_linear.cpp) build them after validation and
// the selection table (selection/grouped_linear_tables.cpp) runs them.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace patchgemm {

// One of the three GEMMs of grouped linear, over [G, B, D] views of the activations (a transpose of
// [B, G, D] ones, never a copy): c_g = a_g @ b_g (+ bias_g), written into `out` (contiguous, in the
// op's layout; `c` is its [G, ...] view).
struct GroupedProblem {
  const char* op = "";
  at::Tensor a, b;                 // [G, M, K], [G, K, N]
  std::optional<at::Tensor> bias;  // [G, N]
  at::Tensor out, c;               // the op's output, and c = its [G, M, N] view
  at::Device device() const { return a.device(); }  // where it runs (choices are kept per device)
};

}  // namespace patchgemm
