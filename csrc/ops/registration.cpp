// Every op's schema, in one place. Kernels are registered per backend beside their code
// (TORCH_LIBRARY_IMPL), autograd in autograd.cpp; fake kernels are registered from Python
// (patchgemm/ops.py) and autocast is applied by the functional API (patchgemm/functional.py).
#include <torch/library.h>

#include <climits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/strided_gemm.h"
#include "selection/registry.h"

#ifndef PATCHGEMM_FLAVOUR
#define PATCHGEMM_FLAVOUR "cpu"
#endif
#ifndef PATCHGEMM_ARCHS
#define PATCHGEMM_ARCHS ""
#endif

TORCH_LIBRARY(patchgemm, m) {
  // Grouped linear: x holds G groups of Din features, [B, G, Din] or (group_major) [G, B, Din];
  // y[.., g, :] = x[.., g, :] @ weight[g].T + bias[g], in x's layout, contiguous.
  m.def("grouped_linear(Tensor x, Tensor weight, Tensor? bias, bool group_major) -> Tensor");
  // d(loss)/dx = grad_y @ weight[g], in grad_y's layout.
  m.def("grouped_linear_grad_input(Tensor grad_y, Tensor weight, bool group_major) -> Tensor");
  // d(loss)/dweight[g] = grad_y[.., g, :].T @ x[.., g, :], [G, Dout, Din].
  m.def("grouped_linear_grad_weight(Tensor grad_y, Tensor x, bool group_major) -> Tensor");

  // Ragged grouped linear (mixture-of-experts layers): x [N, Din] sorted by group, offsets [G] the
  // cumulative group sizes (int32/int64, CPU or x's device; sizes may be 0); y [N, Dout] with
  // y[rows of g] = x[rows of g] @ weight[g].T + bias[g]. Backward: grad_x [N, Din], grad_weight
  // [G, Dout, Din] (zeros for an empty group).
  m.def("ragged_grouped_linear(Tensor x, Tensor weight, Tensor? bias, Tensor offsets) -> Tensor");
  m.def("ragged_grouped_linear_grad_input(Tensor grad_y, Tensor weight, Tensor offsets) -> Tensor");
  m.def("ragged_grouped_linear_grad_weight(Tensor grad_y, Tensor x, Tensor offsets) -> Tensor");

  // Grouped pointwise convolution: F.conv{1,2,3}d(x, weight, bias, groups=groups) with kernel 1;
  // x [B, C_in, *S], weight [C_out, C_in / groups, 1, ...], bias [C_out]; y [B, C_out, *S] in the
  // memory format x suggests. Backward: grad_x (grad_y's format), grad_weight (weight's shape) and,
  // where with_bias, the bias gradient [C_out] (else an empty tensor), which some kernels sum in the
  // same pass.
  m.def("grouped_pointwise_conv(Tensor x, Tensor weight, Tensor? bias, int groups) -> Tensor");
  m.def("grouped_pointwise_conv_grad_input(Tensor grad_y, Tensor weight, int groups) -> Tensor");
  m.def(
      "grouped_pointwise_conv_grad_weight(Tensor grad_y, Tensor x, int groups, bool with_bias=False) -> (Tensor, "
      "Tensor)");

  // SwiGLU, the activation of gated MLPs: gate_up [..., 2H] holds gate and up side by side;
  // h [..., H] = silu(gate) * up, and its backward grad_gate_up [..., 2H] from grad_h and gate_up.
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad_h, Tensor gate_up) -> Tensor");

  // Kernel == stride convolution: x [B, C, *S] (any strides), weight [E, C, *k] (the conv
  // layout), bias [E]; y = conv(x, weight, bias, stride=k) as channels-first [B, E, *grid] or
  // tokens [B, N, E]. `levels` (tokens only) orders the tokens level by level, coarse first, each
  // level a group of one size per spatial dim whose products per dim are the grid; [] is row-major,
  // and so is None (what AOTInductor's proxy executor hands an op for an empty int list).
  m.def("patch_embed(Tensor x, Tensor weight, Tensor? bias, bool tokens, int[]? levels) -> Tensor");
  // Its transpose: x channels-first [B, C_in, *grid] (levels = []) or tokens [B, N, C_in] (levels
  // give the grid and token order), weight [C_in, C_out, *k] (the ConvTranspose layout), bias
  // [C_out]; y = conv_transpose(x, weight, bias, stride=k), [B, C_out, *(grid * k)], contiguous.
  m.def("patch_unembed(Tensor x, Tensor weight, Tensor? bias, bool tokens, int[]? levels) -> Tensor");
  // (grad_weight [E, C, *k], grad_bias [E] or [0]) of patch_embed from grad_y (its output format)
  // and x. `transposed`: patch_unembed's, with (x, grad_y) in these roles swapped, grad_bias then
  // [C] (x summed per channel).
  m.def(
      "patch_weight_grad(Tensor grad_y, Tensor x, int[] kernel_size, bool tokens, int[]? levels, "
      "bool with_bias, bool transposed=False) -> (Tensor, Tensor)");

  // The patch matrix of x [B, C, *S] (any strides; S divisible by kernel_size): [B * N, K], K = C *
  // prod(kernel_size), rows in patch_embed's token order, columns in the conv weight's (c, k...) order,
  // contiguous; the GEMM operand of the FP8 patch paths (patchgemm/fp8.py). Its adjoint scatters
  // such a matrix back into x's shape, contiguous.
  m.def("patch_matrix(Tensor x, int[] kernel_size) -> Tensor");
  m.def("patch_matrix_backward(Tensor grad, int[] x_shape, int[] kernel_size) -> Tensor");

  // Instance norm (statistics per sample and channel over the spatial dims or tokens), then the
  // affine weight/bias and GELU when `gelu`: x is channels-first [B, C, *spatial] or (tokens)
  // [B, N, C]. Returns (y in x's shape, mean [B, C], rstd [B, C]) in float32 (float64 for float64 x).
  m.def(
      "instance_norm_act(Tensor x, Tensor? weight, Tensor? bias, float eps, bool gelu, bool tokens) "
      "-> (Tensor, Tensor, Tensor)");
  // (grad_x, grad_weight, grad_bias) of instance_norm_act from its input and statistics;
  // grad_weight / grad_bias are [0] where weight / bias are None.
  m.def(
      "instance_norm_act_backward(Tensor grad_y, Tensor x, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, bool gelu, bool tokens) -> (Tensor, Tensor, Tensor)");

  // FP8 with one scale per tensor: (data, data_t, scale) with data = saturate(x * (1 / scale)) in `format`
  // (float8_e4m3fn or float8_e5m2), contiguous in x's shape where `rowwise` (else empty), data_t the
  // same values with x's last two dims swapped, contiguous, where `transposed` (else empty), and
  // scale = amax / max(format) (1 for amax 0), a float32 scalar: x ~ scale * data; and where
  // `column_sums`, x summed over its second-to-last dim in x's dtype (accumulated in fp32; else
  // empty): the bias gradient of an output gradient quantized for the weight gradient's GEMM.
  // amax = amax(|x|) (current scaling), or with `amax_state` (float32 [L + 2], zeros before its
  // first call) delayed scaling: the largest amax of the last L calls (x's own while none is
  // recorded), and x's amax recorded in the state, in place (problems/fp8.h: its layout).
  m.def(
      "quantize_fp8(Tensor x, ScalarType format, bool rowwise=True, bool transposed=False, bool column_sums=False, "
      "Tensor(a!)? amax_state=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // The grouped linear of FP8 operands: a [B, G, K] or (group_major) [G, B, K], b [G, N, K], per-tensor
  // scales (float32 scalars); y[.., g, :] = scale_a * scale_b * a[.., g, :] @ b[g].T + bias[g] in a's
  // layout, contiguous, of out_dtype (bias [G, N] of out_dtype). `fast_accum`: Hopper's faster FP8
  // accumulation. Each pass of an FP8 grouped linear is one of these (patchgemm/fp8.py).
  m.def(
      "scaled_grouped_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, bool group_major, "
      "ScalarType out_dtype, bool fast_accum=False) -> Tensor");
  // The ragged grouped linear of FP8 operands: a [N, K] sorted by group (group g its rows
  // offsets[g-1] .. offsets[g], as ragged_grouped_linear's offsets), b [G, Nc, K], per-tensor scales;
  // y_g = scale_a * scale_b * a_g @ b[g].T + bias[g], [N, Nc] contiguous of out_dtype (bias [G, Nc] of
  // out_dtype). The forward and input-gradient GEMMs of an FP8 ragged grouped linear.
  m.def(
      "scaled_ragged_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, Tensor offsets, "
      "ScalarType out_dtype, bool fast_accum=False) -> Tensor");

  // "cpu" | "cuda" | "rocm", the arch list it was built for, and the BLAS library version.
  m.def("build_info() -> str[]", []() -> std::vector<std::string> {
    return {PATCHGEMM_FLAVOUR, PATCHGEMM_ARCHS, patchgemm::blas_version()};
  });
  // Testing hook: the BLAS integer limit the planner splits at (returns the previous one).
  m.def("_set_blas_int_limit(int limit) -> int",
        [](int64_t limit) {
          TORCH_CHECK(limit >= 1 && limit <= INT_MAX, "_set_blas_int_limit: limit must be in [1, ",
                      INT_MAX, "], got ", limit);
          return patchgemm::set_blas_int_limit(limit);
        });
  // Selection (selection/registry.h), for patchgemm.kernels / force / explain: every candidate as
  // "op|name|backends|conditions"; pin one for an op ("" unpins; returns the previous one); record
  // the choices made between a start (returns a mark) and a stop (returns them as JSON objects).
  m.def("_kernels() -> str[]", []() -> std::vector<std::string> {
    std::vector<std::string> rows;
    for (const auto& c : patchgemm::selection::candidates()) {
      rows.push_back(c.op + "|" + c.name + "|" + c.backends + "|" + c.conditions);
    }
    return rows;
  });
  m.def("_force(str op, str name) -> str", [](const std::string& op, const std::string& name) {
    return patchgemm::selection::force(op, name);
  });
  // Testing hook: the default choice without its rules and without the named candidates.
  m.def("_set_selection_testing(bool rules, str[] excluded) -> ()",
        [](bool rules, std::vector<std::string> excluded) {
          patchgemm::selection::set_testing(rules, std::move(excluded));
        });
  m.def("_explain_start() -> int", []() { return patchgemm::selection::start_recording(); });
  m.def("_explain_stop(int mark) -> str[]", [](int64_t mark) { return patchgemm::selection::stop_recording(mark); });
  // The selection mode (patchgemm.set_selection): "heuristic", "autotune" or "learned", with the
  // autotune cache directory ("" for memory only) and the software part of its files' key.
  m.def("_set_selection_mode(str mode, str cache_dir, str environment) -> ()",
        [](const std::string& mode, const std::string& cache_dir, const std::string& environment) {
          using patchgemm::selection::Mode;
          TORCH_CHECK_VALUE(mode == "heuristic" || mode == "autotune" || mode == "learned",
                            "_set_selection_mode: unknown mode \"", mode, "\"");
          const Mode m = mode == "autotune" ? Mode::kAutotune : mode == "learned" ? Mode::kLearned : Mode::kHeuristic;
          patchgemm::selection::set_mode(m, cache_dir, environment);
        });
  m.def("_forget_selections() -> ()", []() { patchgemm::selection::forget(); });
  m.def("_autotune_records() -> str[]", []() { return patchgemm::selection::autotune_records(); });
  // A learned model for one op (selection/learned.cpp has the layout of params); no candidates removes it.
  // backends: the ones ("cpu", "cuda", "rocm") whose records trained it (empty: any).
  m.def("_set_learned_model(str op, str[] candidates, str[] features, int hidden, float[] params, "
        "str[] backends) -> ()",
        [](const std::string& op, std::vector<std::string> candidates, std::vector<std::string> features,
           int64_t hidden, std::vector<double> params, std::vector<std::string> backends) {
          patchgemm::selection::set_learned_model(op, std::move(candidates), std::move(features), hidden,
                                                  std::move(params), std::move(backends));
        });
  // Scores within this gap of the best are timed in learned mode (0: never), for budget_ms at most.
  m.def("_set_learned_unsure_gap(float gap, float budget_ms) -> ()",
        [](double gap, double budget_ms) { patchgemm::selection::set_learned_unsure_gap(gap, budget_ms); });
}
