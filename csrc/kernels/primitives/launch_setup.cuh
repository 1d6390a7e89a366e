// Launch setup that never changes for a kernel, its block size and shared memory on a device:
// raising the kernel's dynamic shared-memory limit and asking how many of its blocks an SM holds.
// Both are driver calls that cost microseconds of host time per call, so they run once per
// (kernel, device, threads, bytes) and the answer is kept. NVIDIA only, as the kernels using it.
// Every kernel launched with more than 48 KiB of dynamic shared memory goes through one of the two.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace patchgemm {
namespace cuda {

struct LaunchShape {
  int blocks_per_sm;  // resident blocks of the kernel per SM (0: none fits)
  int sms;            // the device's SM count
};

// Raises `kernel`'s dynamic shared-memory limit on the current device to at least `smem_bytes`;
// the driver is called only when the limit set so far is lower. Throws if the call fails.
inline void allow_dynamic_smem(const void* kernel, int smem_bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> limits;  // (kernel, device) -> bytes allowed
  const auto key = std::make_pair(kernel, c10::cuda::current_device());
  const std::lock_guard<std::mutex> lock(mutex);
  int& allowed = limits[key];
  if (allowed >= smem_bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  allowed = smem_bytes;
}

// For the current device. Throws if a driver call fails.
inline LaunchShape prepare_launch(const void* kernel, int threads, int smem_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int>, LaunchShape> shapes;
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(kernel, device, threads, smem_bytes);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = shapes.find(key);
  if (found != shapes.end()) return found->second;
  allow_dynamic_smem(kernel, smem_bytes);
  LaunchShape shape{0, at::cuda::getDeviceProperties(device)->multiProcessorCount};
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shape.blocks_per_sm, kernel, threads, smem_bytes));
  shapes.emplace(key, shape);
  return shape;
}

}  // namespace cuda
}  // namespace patchgemm
