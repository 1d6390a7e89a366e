// SwiGLU: h = silu(gate) * up over gate_up [..., 2H] (gate first), the activation of gated MLPs
// (grouped_mlp). Validation here, once; the tables in selection/swiglu_tables.cpp run it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "selection/swiglu_tables.h"

namespace patchgemm {
namespace {

void check_gate_up(const char* op, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1, op, ": gate_up must be [..., 2H], got a 0-D tensor");
  check_floating(op, "gate_up", gate_up);
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, op,
              ": gate_up's last dim holds gate and up side by side and must be even, got shape ", gate_up.sizes());
}

}  // namespace

at::Tensor swiglu(const at::Tensor& gate_up) {
  check_gate_up("swiglu", gate_up);
  return select_swiglu({gate_up.contiguous(), at::Tensor()});
}

at::Tensor swiglu_backward(const at::Tensor& grad_h, const at::Tensor& gate_up) {
  constexpr const char* op = "swiglu_backward";
  check_gate_up(op, gate_up);
  check_like(op, "grad_h", grad_h, "gate_up", gate_up);
  std::vector<int64_t> expected = gate_up.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(grad_h.sizes() == at::IntArrayRef(expected), op, ": grad_h must be ", at::IntArrayRef(expected),
              " (gate_up ", gate_up.sizes(), " with its last dim halved), got ", grad_h.sizes());
  return select_swiglu_backward({gate_up.contiguous(), grad_h.contiguous()});
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}
#endif

}  // namespace patchgemm
