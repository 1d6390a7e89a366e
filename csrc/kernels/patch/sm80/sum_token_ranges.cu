// The weight-gradient kernels' last step (implicit_patch_weight_grad*.cu; column_sums.cu for a bias
// gradient alone): their blocks split the tokens, the reduction, into ranges and write fp32 partial
// sums; this adds them over the ranges in a fixed order (deterministic, unlike atomics) into the
// output dtype.
#include <ATen/ATen.h>

#include <ATen/cuda/CUDAContext.h>

#include <cstdint>

#include "kernels/primitives/dependent_launch.cuh"
#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

// In vectors of 4: the first dw_blocks blocks take dW's, a thread per vector over its few ranges;
// the rest dbias's, a warp per vector over its many.
template <typename T>
__global__ void sum_token_ranges_kernel(const float4* __restrict__ dw_partial, int64_t dw_vectors, int dw_ranges,
                                        int64_t dw_blocks, const float4* __restrict__ db_partial, int db_vectors,
                                        int db_ranges, uint2* __restrict__ dw, uint2* __restrict__ db) {
  wait_for_prior_kernels();  // launched dependent (dependent_launch.cuh): the partial sums' kernel
  float4 sum = {0.f, 0.f, 0.f, 0.f};
  auto add = [&](const float4& v) { sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w; };
  if (blockIdx.x < dw_blocks) {
    const int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
    if (v >= dw_vectors) return;
    for (int r = 0; r < dw_ranges; ++r) add(dw_partial[r * dw_vectors + v]);
    dw[v] = {pack2<T>(sum.x, sum.y), pack2<T>(sum.z, sum.w)};
    return;
  }
  const int v = static_cast<int>((blockIdx.x - dw_blocks) * (blockDim.x / 32) + threadIdx.x / 32),
            lane = threadIdx.x % 32;
  if (v >= db_vectors) return;
  for (int r = lane; r < db_ranges; r += 32) add(db_partial[int64_t{r} * db_vectors + v]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum.x += __shfl_xor_sync(0xffffffffu, sum.x, offset), sum.y += __shfl_xor_sync(0xffffffffu, sum.y, offset);
    sum.z += __shfl_xor_sync(0xffffffffu, sum.z, offset), sum.w += __shfl_xor_sync(0xffffffffu, sum.w, offset);
  }
  if (lane == 0) db[v] = {pack2<T>(sum.x, sum.y), pack2<T>(sum.z, sum.w)};
}

}  // namespace

void sum_token_ranges(const at::Tensor& dw_partial, const at::Tensor& db_partial, const at::Tensor& dw,
                      const at::Tensor& db) {
  const bool with_dw = dw_partial.defined(), with_db = db.defined();
  TORCH_CHECK((!with_dw || dw.numel() % 4 == 0) && (!with_db || db.numel() % 4 == 0),
              "sum_token_ranges: sizes must be multiples of 4");
  const int64_t dw_vectors = with_dw ? dw.numel() / 4 : 0, dw_blocks = (dw_vectors + 255) / 256;
  const int db_vectors = with_db ? static_cast<int>(db.numel() / 4) : 0;
  const int64_t blocks = dw_blocks + (db_vectors + 7) / 8;
  if (blocks == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    launch_dependent(
        sum_token_ranges_kernel<T>, static_cast<unsigned>(blocks), 256, 0, stream,
        with_dw ? reinterpret_cast<const float4*>(dw_partial.const_data_ptr<float>()) : nullptr, dw_vectors,
        with_dw ? static_cast<int>(dw_partial.size(0)) : 0, dw_blocks,
        with_db ? reinterpret_cast<const float4*>(db_partial.const_data_ptr<float>()) : nullptr, db_vectors,
        with_db ? static_cast<int>(db_partial.size(0)) : 0, with_dw ? static_cast<uint2*>(dw.data_ptr()) : nullptr,
        with_db ? static_cast<uint2*>(db.data_ptr()) : nullptr);
  };
  const at::ScalarType type = (with_dw ? dw : db).scalar_type();
  type == at::kHalf ? run(static_cast<__half*>(nullptr)) : run(static_cast<__nv_bfloat16*>(nullptr));
}

}  // namespace cuda
}  // namespace patchgemm
