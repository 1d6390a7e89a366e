// Argument checks shared by the ops: every message names the op, the argument and the shapes.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <initializer_list>

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

// Whether the autograd layer may run a call's C++ directly instead of through the dispatcher (ops/
// autograd.cpp): every tensor (undefined ones: absent) a dense CPU or CUDA tensor with concrete
// sizes, and no TorchDispatchMode active. Elsewhere (torch.compile's fake and functional tensors,
// subclasses, modes, other devices) the dispatcher finds the kernel that handles them.
inline bool plain_call(std::initializer_list<at::Tensor> tensors) {
  static const c10::DispatchKeySet plain_keys({c10::DispatchKey::CPU, c10::DispatchKey::CUDA,
                                               c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA,
                                               c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU,
                                               c10::DispatchKey::AutocastCUDA});
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python)) return false;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (!plain_keys.has_all(t.key_set()) || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  }
  return true;
}

}  // namespace patchgemm
