// Launch setup that never changes for a kernel, its block size and shared memory on a device:
// raising the kernel's dynamic shared-memory limit and asking how many of its blocks an SM holds.
// Both are driver calls that cost microseconds of host time per call, so they run once per
// (kernel, device, threads, bytes) and the answer is kept. NVIDIA only, as the kernels using it.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

namespace patchgemm {
namespace cuda {

struct LaunchShape {
  int blocks_per_sm;  // resident blocks of the kernel per SM (0: none fits)
  int sms;            // the device's SM count
};

// For the current device. Throws if a driver call fails.
inline LaunchShape prepare_launch(const void* kernel, int threads, int smem_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int>, LaunchShape> shapes;
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(kernel, device, threads, smem_bytes);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = shapes.find(key);
  if (found != shapes.end()) return found->second;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  LaunchShape shape{0, at::cuda::getDeviceProperties(device)->multiProcessorCount};
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shape.blocks_per_sm, kernel, threads, smem_bytes));
  shapes.emplace(key, shape);
  return shape;
}

}  // namespace cuda
}  // namespace patchgemm
