// Ragged grouped GEMMs whose group bounds stay on the GPU (kernels/gemm/ragged_gemm.cu): every block
// finds its group from the offsets itself, so nothing is read on the host and a CUDA graph can
// capture the call and replay it with other sizes (ragged_groups.cuh: how).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace patchgemm {
namespace cuda {

// offsets [G] (int32 or int64, contiguous, on a's device): each group's end in the ragged dim
// (cumulative sizes).
// ragged_k false, the rows split:     out[s:e] = a[s:e] @ b[g] (+ bias[g]) for group g's rows s .. e;
//                                     a [N, K], b [G, K, Nc], bias [G, Nc], out [N, Nc].
// ragged_k true, the reduction split: out[g] = a[:, s:e] @ b[s:e] (zeros for an empty group);
//                                     a [M, N], b [N, Nc], out [G, M, Nc].
// Any strides. Offsets that decrease, pass the ragged dim or do not end at it fail a device-side
// assert (the next synchronizing call raises). *_declines: empty where the kernel takes the problem,
// else why not; *_into runs it (where it declines, an internal error).

// Portable: any float dtype, 64 x 64 tiles of fp32 products and sums (fp64 for float64) on the
// CUDA cores.
std::string ragged_gemm_declines(const at::Tensor& a, const at::Tensor& b, bool ragged_k, int64_t groups);
void ragged_gemm_into(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                      const at::Tensor& offsets, bool ragged_k, const at::Tensor& out);

// float16 / bfloat16 on tensor cores (sm_80+; kernels/gemm/sm80/ragged_gemm_mma.cu, NVIDIA builds
// only): 128 x 128 tiles, fp32 sums.
std::string ragged_gemm_mma_declines(const at::Tensor& a, const at::Tensor& b, bool ragged_k, int64_t groups);
void ragged_gemm_mma_into(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                          const at::Tensor& offsets, bool ragged_k, const at::Tensor& out);

}  // namespace cuda
}  // namespace patchgemm
