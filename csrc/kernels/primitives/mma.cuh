// Warp-level tensor-core building blocks shared by the fused patch kernels (sm_80+ PTX: ldmatrix,
// mma.sync, cp.async), and the implicit GEMMs' pipelined main loop. NVIDIA only: the kernels that include this are
// compiled out on ROCm.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace patchgemm {
namespace cuda {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ldmatrix: the calling lane's row address is a shared-memory address (smem_address) or pointer.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, smem_address(p)); }

// The transposing form: each 8 x 8 matrix arrives as its transpose (a row-major [k][n] shared tile
// read as the column-major B operand).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* p) { ldmatrix_x2(r, smem_address(p)); }

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

// d += a (16 x 16, row-major) @ b (16 x 8, column-major), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// d += a (16 x 8, row-major) @ b (8 x 8, column-major) in TF32 (fragments from to_tf32), fp32
// accumulators; the fragment layouts of m16n8k16 with 32-bit elements and half the k.
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// v rounded to the nearest TF32 value (ties away from zero), as an mma operand.
__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
}

// Asynchronous copy of kBytes (4, 8 or 16) from global memory to the shared-memory address dst;
// zero-fills instead of reading when !valid (src must still be a mapped address).
template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {  // .cg (L2 only) exists for 16 bytes alone
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(kBytes),
                 "r"(src_bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The main loop of the implicit GEMM kernels: a kStages-deep cp.async pipeline of kTileK-wide K
// slices with double-buffered fragments. load_slice(k_tile, slot) issues one slice's copies into a
// shared-memory slot, load_fragments(buffer, slot, k) loads the 16-wide step at k of a landed slot,
// multiply(buffer) runs one step's mma.sync. Returns with every copy landed (the caller syncs before
// reusing shared memory).
template <int kStages, int kTileK, typename LoadSlice, typename LoadFragments, typename Multiply>
__device__ __forceinline__ void pipelined_main_loop(int k_tiles, LoadSlice&& load_slice, LoadFragments&& load_fragments,
                                                    Multiply&& multiply) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_slice(s, s);
    cp_async_commit();
  }
  for (int kt = 0, slot = 0; kt < k_tiles; ++kt, slot = slot + 1 == kStages ? 0 : slot + 1) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slice kt has landed for every thread; the slot of slice kt - 1 is free again
    load_fragments(0, slot, 0);
    if (kt + kStages - 1 < k_tiles) load_slice(kt + kStages - 1, slot == 0 ? kStages - 1 : slot - 1);
    cp_async_commit();
#pragma unroll
    for (int step = 0; step < kTileK / 16; ++step) {
      if (step + 1 < kTileK / 16) load_fragments((step + 1) % 2, slot, (step + 1) * 16);
      multiply(step % 2);
    }
  }
  cp_async_wait<0>();
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// pack2's inverse: the two 16-bit values of v (lo in the low half) as floats.
template <typename T>
__device__ __forceinline__ void unpack2(uint32_t v, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xffff0000u);
  } else {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xffffu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
  }
}

// (torch builds with __CUDA_NO_HALF_CONVERSIONS__: no implicit float <-> 16-bit conversions.)
template <typename T>
__device__ __forceinline__ T zero() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(0.f);
  } else {
    return __float2half(0.f);
  }
}

// A float rounded to nearest into T (T: __half or __nv_bfloat16).
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

}  // namespace cuda
}  // namespace patchgemm
