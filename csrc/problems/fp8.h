// The FP8 ops' problems, as the ops (ops/fp8.cpp) build them after validation and the tables
// (selection/fp8_tables.cpp) run them.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace patchgemm {

// A delayed-scaling state: float32 [L + 2] = [the amax to scale from, the amax being observed (0
// between calls), the amaxes of the last L calls, newest first]; all zeros before the first call.
// While the amax to scale from is 0 (no call recorded a nonzero amax), a call measures x's amax
// first and scales by it, as current scaling does. 1 <= L <= kMaxAmaxHistory.
constexpr int64_t kMaxAmaxHistory = 1024;

// quantize_fp8: x contiguous, to `format` (e4m3fn or e5m2) with one scale for the tensor; data in
// x's layout where `rowwise`, the copy with the last two dims swapped where `transposed`, and x
// summed over its second-to-last dim where `column_sums` (a bias gradient, read in the same pass).
// The scale from x's amax (current scaling), or from `amax_state` (delayed scaling, updated in
// place).
struct QuantizeProblem {
  at::Tensor x;
  at::ScalarType format;
  bool rowwise = true, transposed = false, column_sums = false;
  at::Tensor amax_state;  // undefined: current scaling
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)
};
// quantize_fp8's outputs: data, data_t, scale, sums (an empty tensor for each not asked for).
using QuantizeOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// scaled_grouped_mm over [G, ...] views: c_g [M, N] = scale_a * scale_b * a_g [M, K] @ b_g [N, K]^T
// (+ bias_g), written into `out` (contiguous, in the op's layout; `c` is its [G, M, N] view).
struct ScaledGroupedProblem {
  at::Tensor a, b;                 // FP8, [G, M, K] and [G, N, K]
  at::Tensor scale_a, scale_b;     // float32 scalars
  std::optional<at::Tensor> bias;  // [G, N], of out's dtype
  bool fast_accum = false;
  at::Tensor out, c;
  at::Device device() const { return a.device(); }  // where it runs (choices are kept per device)
};

// scaled_ragged_mm: out_g [rows of group g, Nc] = scale_a * scale_b * a_g @ b[g]^T (+ bias[g]).
struct ScaledRaggedProblem {
  at::Tensor a, b;                 // FP8, [N, K] (rows sorted by group) and [G, Nc, K], K contiguous
  at::Tensor scale_a, scale_b;     // float32 scalars
  std::optional<at::Tensor> bias;  // [G, Nc], of out_dtype
  at::Tensor offsets;              // [G] cumulative sizes, int32 or int64, on the CPU or a's device
  at::ScalarType out_dtype;
  bool fast_accum = false;
  at::Device device() const { return a.device(); }  // where it runs (choices are kept per device)
};

}  // namespace patchgemm
