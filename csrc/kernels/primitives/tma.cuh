// Hopper's tensor memory accelerator (TMA) for the wgmma kernels. The host encodes a tensor map (a
// strided view of global memory and the box one copy moves); one thread then lands a whole operand
// tile in shared memory, in the tensor cores' 128B swizzle, with one instruction, and an mbarrier per
// pipeline slot says when its bytes have arrived. The cp.async copies it replaces cost every thread a
// 16-byte copy and its 64-bit address arithmetic each, which is what the wgmma kernels would
// stall on.
#pragma once

// NVIDIA only: the kernels that include this (*_sm90.cu) are compiled out on ROCm.
#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAMiscFunctions.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <mutex>

namespace patchgemm {
namespace cuda {

// A driver entry point by name (the library does not link libcuda itself); an error if missing.
template <typename Fn>
Fn driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  const cudaError_t error = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  TORCH_CHECK(error == cudaSuccess && found == cudaDriverEntryPointSuccess, "patchgemm: the driver has no ",
              name, " (", cudaGetErrorString(error), ", query result ", static_cast<int>(found),
              "); the sm_90a kernels need a CUDA 12+ driver");
  return reinterpret_cast<Fn>(fn);
}

// The driver API works in the calling thread's current context, which a thread that has made no
// CUDA runtime call that needs one does not have (an autograd worker or a server thread whose first
// GPU work is ours): the device's primary context is made current as the runtime would do it, under
// the allocator's free mutex as PyTorch does.
inline void ensure_current_context() {
  static const auto get_current = driver_entry_point<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent");
  CUcontext context = nullptr;
  if (get_current(&context) == CUDA_SUCCESS && context != nullptr) return;
  const std::lock_guard<std::mutex> lock(*c10::cuda::getFreeMutex());
  C10_CUDA_CHECK(cudaFree(nullptr));
}

// Encodes `map` for the 16-bit tensor at `base` with `rank` dimensions, innermost first: sizes
// `dims`, byte strides of dimensions 1.. `strides` (multiples of 16), and `box` elements per copy
// (box[0] * 2 <= 128 bytes: one swizzled row; unswizzled, up to 256 elements), landing in shared
// memory in `swizzle` (the tensor cores' 128B mode; 32B or 64B for boxes of such rows). Elements
// outside the tensor read as zeros (and are not written by stores). false where the layout does not
// allow a map (base or strides not 16-byte multiples, box rows too long): callers check those first.
// A driver without the entry point, or one that refuses the map, is an error, never "unsupported".
inline bool encode_tensor_map(CUtensorMap& map, const void* base, int rank, const uint64_t* dims,
                              const uint64_t* strides, const uint32_t* box,
                              CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  static const auto encode = driver_entry_point<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  if (reinterpret_cast<uintptr_t>(base) % 16 || box[0] * 2 > (swizzle == CU_TENSOR_MAP_SWIZZLE_NONE ? 512 : 128)) {
    return false;
  }
  for (int d = 0; d + 1 < rank; ++d) {
    if (strides[d] % 16) return false;
  }
  const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
  ensure_current_context();
  const CUresult result = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, rank, const_cast<void*>(base), dims, strides,
                                 box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "patchgemm: cuTensorMapEncodeTiled failed with CUresult ",
              static_cast<int>(result), " (rank ", rank, ", innermost size ", dims[0], ", box ", box[0], ")");
  return true;
}

// The patch-row kernels' boxes of contiguous x [.., W = gw * kw]: a box is kh_box image rows of pw
// patch rows (pw >= gw, a multiple of 8: the ones past gw read as zeros). Neighbouring patches' rows
// of an image row are contiguous, so a box row holds as many of them as fit in 128 bytes and divide
// gw (ViT-B/16's 14-patch rows: pairs of 16-element rows). TMA moves short box rows slowly; the
// layout in shared memory is [kh_box][pw][kw] all the same, in the swizzle of the box row's bytes.
inline int patches_per_box_row(int kw, int gw) {
  int f = 128 / (kw * 2);
  while (gw % f) f /= 2;
  return f;
}

// The 16-byte chunk bits that the boxes' swizzle flips with address bits 7 and up.
inline uint32_t patch_box_swizzle_mask(int kw, int gw) {
  return static_cast<uint32_t>(kw * 2 * patches_per_box_row(kw, gw) / 16 - 1) << 4;
}

// x viewed as [image_rows][gw / f][kw * f], f = patches_per_box_row.
inline bool encode_patch_box_map(CUtensorMap& map, const void* x, uint64_t image_rows, int kw, int gw, int pw,
                                 int kh_box) {
  const int f = patches_per_box_row(kw, gw), row = kw * f;
  const CUtensorMapSwizzle swizzle = row == 16   ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : row == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                     : row == 64 ? CU_TENSOR_MAP_SWIZZLE_128B
                                                 : CU_TENSOR_MAP_SWIZZLE_NONE;
  const uint64_t dims[3] = {static_cast<uint64_t>(row), static_cast<uint64_t>(gw / f), image_rows};
  const uint64_t strides[2] = {static_cast<uint64_t>(row) * 2, static_cast<uint64_t>(gw) * kw * 2};
  const uint32_t box[3] = {static_cast<uint32_t>(row), static_cast<uint32_t>(pw / f), static_cast<uint32_t>(kh_box)};
  return encode_tensor_map(map, x, 3, dims, strides, box, swizzle);
}

// The kw = 2 pair-box kernels' map of contiguous t [B, C, D, H, W = 2 gw] (x of the forward, y of
// the unembedding; implicit_patch_gemm_pairs_sm90.cu explains): t as the 5-D [B*C][D][kh][gh][W]
// (innermost last; the grid-row dimension outside the row-in-patch one), a box [cs][kd][kh][128 /
// gw][W] = [pair (c, i, j)][token] 32-bit words for 128 tokens, in the swizzle of its 4 gw-byte rows.
inline bool encode_pair_box_map(CUtensorMap& map, const void* t, uint64_t planes, uint64_t D, uint64_t H, uint64_t W,
                                int kd, int kh, int cs) {
  const uint64_t gw = W / 2;
  const uint64_t dims[5] = {W, H / kh, static_cast<uint64_t>(kh), D, planes};  // planes: B * C
  const uint64_t strides[4] = {kh * W * 2, W * 2, H * W * 2, D * H * W * 2};
  const uint32_t box[5] = {static_cast<uint32_t>(W), static_cast<uint32_t>(128 / gw), static_cast<uint32_t>(kh),
                           static_cast<uint32_t>(kd), static_cast<uint32_t>(cs)};
  const CUtensorMapSwizzle swizzle = gw == 8 ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : gw == 16 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                : CU_TENSOR_MAP_SWIZZLE_128B;
  return encode_tensor_map(map, t, 5, dims, strides, box, swizzle);
}

// The byte offset of word (pair, token) in a pair box (above), swizzled (the box 1024-byte aligned).
__device__ __forceinline__ uint32_t pair_box_offset(int pair, int token, int gw) {
  const uint32_t offset = (pair * 128 + token) * 4, mask = static_cast<uint32_t>(gw / 4 - 1) << 4;
  return offset ^ (offset >> 3 & mask);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint64_t tensor_map_address(const CUtensorMap& map) {
  return reinterpret_cast<uint64_t>(&map);
}

// Fetches the map's descriptor ahead of the first copy (it otherwise comes in with that copy).
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map_address(map)) : "memory");
}

// The box at coordinates (c0, c1[, c2]) of `map` into shared memory at `dst` (1024-byte aligned),
// completing its bytes on the mbarrier at `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap& map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap& map, uint32_t bar, int c0, int c1,
                                         int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap& map, uint32_t bar, int c0, int c1,
                                         int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(dst),
      "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// The shared-memory tile at `src` (1024-byte aligned) to the box at coordinates (c0, c1[, c2]) of `map`,
// in this thread's bulk group (parts outside the tensor are not written).
__device__ __forceinline__ void tma_store(const CUtensorMap& map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   tensor_map_address(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store(const CUtensorMap& map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   tensor_map_address(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

__device__ __forceinline__ void tma_store(const CUtensorMap& map, uint32_t src, int c0, int c1, int c2, int c3,
                                          int c4) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(
                   tensor_map_address(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until all but the last kPending of this thread's committed stores have read their shared
// memory (which may then change).
template <int kPending = 0>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until this thread's committed stores are done (written to global memory).
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// One mbarrier per pipeline slot (8 bytes each, from the shared address `base`). Thread 0 arms the
// slot for a slice's bytes before issuing its copies; the slice's use of the slot, kt / kSlots, is
// the phase every thread waits for. Persistent kernels pair these "landed" barriers with "released"
// ones that the consumers arrive on (count: the number of consumers) when they are done with a slot.
template <int kSlots>
struct SlotBarriers {
  uint32_t base;

  // Thread 0 initializes; a block barrier must follow before any use.
  __device__ __forceinline__ void init(uint32_t count = 1) const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kSlots; ++s) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(base + 8 * s), "r"(count));
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
  }

  // Arms slot `slot` to expect `bytes` and returns its barrier for the copies.
  __device__ __forceinline__ uint32_t arm(int slot, uint32_t bytes) const {
    const uint32_t bar = base + 8 * slot;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    return bar;
  }

  // One consumer's arrival on slot `slot`.
  __device__ __forceinline__ void arrive(int slot) const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(base + 8 * slot) : "memory");
  }

  // Waits until slice kt's bytes have landed in its slot (phase kt / kSlots of the slot completed).
  __device__ __forceinline__ void wait(int kt) const {
    asm volatile(
        "{\n.reg .pred landed;\nwait_slot:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 landed, [%0], %1;\n"
        "@!landed bra wait_slot;\n}\n" ::"r"(base + 8 * (kt % kSlots)),
        "r"((kt / kSlots) & 1)
        : "memory");
  }

  // On "released" barriers: waits until slice kt may be copied into its slot, i.e. the consumers
  // released slice kt - kSlots there. A fresh barrier counts its (parity 1) phase before the first
  // as completed, so slices 0 .. kSlots - 1 pass at once.
  __device__ __forceinline__ void wait_released(int kt) const { wait(kt + kSlots); }
};
#endif

}  // namespace cuda
}  // namespace patchgemm
