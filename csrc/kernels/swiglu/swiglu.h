// SwiGLU, the activation of gated MLPs: gate_up [R, 2H] holds a row's gate (first H) and up (last H)
// projections side by side, as one GEMM on a [2H, D] weight makes them; h [R, H] = silu(gate) * up.
// Math in float32 (float64 for float64 input), one pass over memory each way:
//   forward   reads gate_up, writes h;
//   backward  reads grad_h and gate_up, writes grad_gate_up [R, 2H] (grad of gate, then of up):
//             d_gate = grad_h * up * s * (1 + gate * (1 - s)), d_up = grad_h * gate * s,
//             s = sigmoid(gate).
// All tensors contiguous; R = numel / (2H).
#pragma once

#include <ATen/ATen.h>

namespace patchgemm {

// Whether this CPU runs the vectorized loops (x86-64: AVX2 and FMA; elsewhere the baseline ISA);
// without them the loops are scalar and ATen's elementwise ops are faster.
bool swiglu_cpu_is_vectorized();
void swiglu_cpu(const at::Tensor& gate_up, const at::Tensor& h);
void swiglu_backward_cpu(const at::Tensor& grad_h, const at::Tensor& gate_up, const at::Tensor& grad_gate_up);

#ifdef PATCHGEMM_WITH_CUDA
namespace cuda {
void swiglu_into(const at::Tensor& gate_up, const at::Tensor& h);
void swiglu_backward_into(const at::Tensor& grad_h, const at::Tensor& gate_up, const at::Tensor& grad_gate_up);
}  // namespace cuda
#endif

}  // namespace patchgemm
