// Programmatic dependent launch (Hopper): a kernel started by launch_dependent may begin while the
// kernel before it in the stream is finishing. Its blocks take SMs as that kernel's blocks leave
// them and run their prologue (barrier setup, tensor-map prefetches); wait_for_prior_kernels then
// holds them until that kernel has completed and its writes are visible, before their first global
// memory access (read or write: the caching allocator may hand out memory the kernel before used).
// Kernels trigger their dependents by exiting, never early (griddepcontrol.launch_dependents): an
// early trigger starts the next kernel's blocks while this one still runs, where they only wait,
// holding SM slots, and a profiler counts that wait as the next kernel's time (ViT-B/16's stem,
// forward and backward at batch 256, summed 1.5x its kernels' time on an H200, at the same wall
// time). Without the launch attribute the wait does nothing.
#pragma once

// NVIDIA only: the kernels that include this (the *_sm90.cu kernels and sum_token_ranges.cu) are
// compiled out on ROCm.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace patchgemm {
namespace cuda {

__device__ __forceinline__ void wait_for_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = smem, config.stream = stream;
  config.attrs = &attribute, config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace cuda
}  // namespace patchgemm
