// The SwiGLU selection table's entry points (swiglu_tables.cpp):
// the implementation each call runs.
#pragma once

#include <ATen/ATen.h>

#include "problems/swiglu.h"

namespace patchgemm {

// h [..., H] = silu(gate) * up, and grad_gate_up [..., 2H] from grad_h.
at::Tensor select_swiglu(const SwigluProblem& p);
at::Tensor select_swiglu_backward(const SwigluProblem& p);

}  // namespace patchgemm
