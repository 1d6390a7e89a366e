// instance_norm_act's C++ (instance_norm.cpp) that the autograd layer (autograd.cpp) also runs.
#pragma once

#include <ATen/ATen.h>

#include "problems/norm.h"

namespace patchgemm {

// x's [B, C, S] view (ops/instance_norm.cpp), checking x's rank for `op`.
NormShape norm_shape(const char* op, const at::Tensor& x, bool tokens);

}  // namespace patchgemm
