// Argument checks shared by the ops: every message names the op, the argument and the shapes.
#pragma once

#include <ATen/ATen.h>

namespace patchgemm {

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
              op, ": ", name, " must be float32, float16, bfloat16 or float64, got ", dt,
              " (shape ", t.sizes(), ")");
}

// `t` must match `ref` in dtype and device (no silent casts or cross-device reads).
inline void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but ", ref_name, " has dtype ", ref.scalar_type(), " (shapes ", t.sizes(), " and ",
              ref.sizes(), "); cast one of them, or run under torch.autocast");
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device());
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                      const char* expected) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", expected, ", got shape ",
              t.sizes());
}

// Whether x [B, C, *S] lies channels-last (channels_last / channels_last_3d, as ATen suggests): a
// conv replacement's output then takes x's memory format, as PyTorch's convolutions do.
inline bool lies_channels_last(const at::Tensor& x) {
  return x.numel() > 0 && x.suggest_memory_format() != at::MemoryFormat::Contiguous;
}

}  // namespace patchgemm
