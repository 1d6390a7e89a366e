// SwiGLU's problems, as the ops (ops/swiglu.cpp) build them after validation and the
// tables (selection/swiglu_tables.cpp) run them: contiguous tensors of one dtype and device.
#pragma once

#include <ATen/ATen.h>

namespace patchgemm {

struct SwigluProblem {
  at::Tensor gate_up;  // [..., 2H]: gate, then up
  at::Tensor grad_h;   // [..., H]; the backward only
  at::Device device() const { return gate_up.device(); }  // where it runs (choices are kept per device)
};

}  // namespace patchgemm
