// Hopper's warpgroup MMA (wgmma, sm_90a PTX) for the implicit GEMM kernels: shared-memory matrix
// descriptors for 128-byte-swizzled tiles, the m64nNk16 instructions with A from registers (RS) or
// shared memory (SS), their fences, and the kernels' pipelined main loop. Every body is compiled only for sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL); kernels that include this check the same macro.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PATCHGEMM_HAS_WGMMA 1
#endif

// Byte offset of the 16-byte chunk holding byte `byte` of row `row` in a tile of 128-byte rows
// swizzled like the tensor cores' 128B mode: chunk c of row r sits at chunk c ^ (r % 8). The tile
// starts 1024-byte aligned. Spreads a column of chunks over all banks, and is what wgmma reads.
__device__ __forceinline__ uint32_t swizzle_128b(int row, int byte) {
  return static_cast<uint32_t>(row * 128 + ((byte / 16) ^ (row % 8)) * 16 + byte % 16);
}

// Descriptor of an operand tile in shared memory made of 128-byte rows in the 128B swizzle, 8-row
// groups 1024 bytes apart:
//   K-major: a row is one M (or N) index's 64 K elements. Moving `address` 32 bytes steps 16 along K.
//   M- or N-major: a row is one k's 64 M (N) elements, and the next 64 M (N) elements lie
//   `mn_block_bytes` further (a block of 64 rows: 8192). Steps of 16 along K are 2048 bytes.
__device__ __forceinline__ uint64_t smem_descriptor_128b(uint32_t address, uint32_t mn_block_bytes = 16) {
  return uint64_t{(address & 0x3FFFF) >> 4} | uint64_t{(mn_block_bytes >> 4) & 0x3FFF} << 16 |
         uint64_t{1024 >> 4} << 32 | uint64_t{1} << 62;
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef PATCHGEMM_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef PATCHGEMM_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this warpgroup's committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef PATCHGEMM_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Makes this thread's ordinary shared-memory writes (cp.async included) visible to the tensor cores'
// asynchronous reads; then a barrier.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef PATCHGEMM_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Pins the accumulators in place around in-flight wgmmas (the compiler may not move them).
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulators of an m64n128 (m64n192, m64n256) tile as in-out operands %0..%63 (%95, %127), and their list
// in PTX.
#define PATCHGEMM_WGMMA_ACC128(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define PATCHGEMM_WGMMA_ACC192(d) \
  PATCHGEMM_WGMMA_ACC128(d), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define PATCHGEMM_WGMMA_ACC256(d) \
  PATCHGEMM_WGMMA_ACC192(d), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define PATCHGEMM_WGMMA_D0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PATCHGEMM_WGMMA_D128 "{" PATCHGEMM_WGMMA_D0_63 "}"
#define PATCHGEMM_WGMMA_D192 \
  "{" PATCHGEMM_WGMMA_D0_63 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define PATCHGEMM_WGMMA_D256 \
  "{" PATCHGEMM_WGMMA_D0_63 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"


#define PATCHGEMM_WGMMA_RS(N, AB, A_OPS, DESC, ONE, TRANS_B)                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ONE ", 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " " PATCHGEMM_WGMMA_D##N    \
               ", " A_OPS ", " DESC ", p, 1, 1, " TRANS_B ";\n}\n"                                     \
               : PATCHGEMM_WGMMA_ACC##N(d)                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kMajorN ? 1 : 0))
#define PATCHGEMM_WGMMA_SS(N, AB, DESCS, ONE, TRANS_A, TRANS_B)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ONE ", 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " " PATCHGEMM_WGMMA_D##N    \
               ", " DESCS ", p, 1, 1, " TRANS_A ", " TRANS_B ";\n}\n"                                  \
               : PATCHGEMM_WGMMA_ACC##N(d)                                                             \
               : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kMajorM ? 1 : 0), "n"(kMajorN ? 1 : 0))

// d (64 x N per warpgroup, fp32) += a (64 x 16, registers: each warp's 16 rows as mma.sync's A
// fragment) @ b (descriptor of an N x 16 tile, K-major or, with kMajorN, N-major).
template <typename T, int N, bool kMajorN = false>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 128 || N == 192 || N == 256, "wgmma_rs: N = 128, 192 or 256");
#ifdef PATCHGEMM_HAS_WGMMA
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 256 && bf16) {
    PATCHGEMM_WGMMA_RS(256, "bf16", "{%128, %129, %130, %131}", "%132", "%133", "%134");
  } else if constexpr (N == 256) {
    PATCHGEMM_WGMMA_RS(256, "f16", "{%128, %129, %130, %131}", "%132", "%133", "%134");
  } else if constexpr (N == 128 && bf16) {
    PATCHGEMM_WGMMA_RS(128, "bf16", "{%64, %65, %66, %67}", "%68", "%69", "%70");
  } else if constexpr (N == 128) {
    PATCHGEMM_WGMMA_RS(128, "f16", "{%64, %65, %66, %67}", "%68", "%69", "%70");
  } else if constexpr (bf16) {
    PATCHGEMM_WGMMA_RS(192, "bf16", "{%96, %97, %98, %99}", "%100", "%101", "%102");
  } else {
    PATCHGEMM_WGMMA_RS(192, "f16", "{%96, %97, %98, %99}", "%100", "%101", "%102");
  }
#endif
}

// d (64 x N per warpgroup, fp32) += a (descriptor of a 64 x 16 tile, K-major or, with kMajorM,
// M-major) @ b (descriptor of an N x 16 tile, K-major or, with kMajorN, N-major).
template <typename T, int N, bool kMajorM = false, bool kMajorN = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
  static_assert(N == 128 || N == 192, "wgmma_ss: N = 128 or 192");
#ifdef PATCHGEMM_HAS_WGMMA
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 128 && bf16) {
    PATCHGEMM_WGMMA_SS(128, "bf16", "%64, %65", "%66", "%67", "%68");
  } else if constexpr (N == 128) {
    PATCHGEMM_WGMMA_SS(128, "f16", "%64, %65", "%66", "%67", "%68");
  } else if constexpr (bf16) {
    PATCHGEMM_WGMMA_SS(192, "bf16", "%96, %97", "%98", "%99", "%100");
  } else {
    PATCHGEMM_WGMMA_SS(192, "f16", "%96, %97", "%98", "%99", "%100");
  }
#endif
}

// Synchronizes the `threads` threads (whole warps) that use named barrier `id` (0 is __syncthreads's).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void st_shared(uint32_t address, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(v) : "memory");
}

// stmatrix: four 8 x 8 matrices of 16-bit pairs (register i: matrix i, as mma's C fragment) to the
// rows whose addresses lanes 8i .. 8i + 7 give.
__device__ __forceinline__ void stmatrix_x4(uint32_t address, const uint32_t (&r)[4]) {
#ifdef PATCHGEMM_HAS_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#endif
}

__device__ __forceinline__ uint32_t ld_shared(uint32_t address) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(address) : "memory");
  return v;
}

__device__ __forceinline__ uint2 ld_shared_v2(uint32_t address) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(address) : "memory");
  return v;
}

// Sets this warpgroup's registers per thread (setmaxnreg): warp-specialized kernels move them from
// the producer's warpgroup, which needs few, to the consumers' accumulators.
template <int kRegisters, bool kIncrease>
__device__ __forceinline__ void set_max_registers() {
#ifdef PATCHGEMM_HAS_WGMMA
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  }
#endif
}

// The K loop of one tile for a consumer warpgroup whose A goes through registers, in the persistent
// TMA kernels (implicit_patch_gemm_rows_sm90.cu, implicit_patch_gemm_pairs_sm90.cu,
// implicit_patch_weight_grad_rows_sm90.cu). Per slice: wait until it has landed in its slot (base +
// it % kStages * slot_bytes), load its A fragments (load_a(af, slot)), issue its wgmmas as one group
// (issue(af, slot)), then wait for the previous slice's group and give that slot back to the
// producer (`releaser`: one thread per warpgroup). Two register sets alternate, so the registers of
// the group in flight never change under it (ptxas would serialize the wgmmas). Returns with every
// group done and every slot given back; `it` counts the slices consumed over the block's tiles.
template <int kStages, int R, int kSteps, typename Barriers, typename LoadA, typename Issue>
__device__ __forceinline__ void register_a_tile(float (&acc)[R], uint32_t (&a_even)[kSteps][4],
                                                uint32_t (&a_odd)[kSteps][4], int slices, int& it, uint32_t base,
                                                uint32_t slot_bytes, const Barriers& landed, const Barriers& released,
                                                bool releaser, LoadA&& load_a, Issue&& issue) {
  auto slice = [&](uint32_t(&af)[kSteps][4], bool first) {
    const uint32_t slot = base + it % kStages * slot_bytes;
    landed.wait(it);
    load_a(af, slot);
    fence_accumulators(acc);
    wgmma_fence();
    issue(af, slot);
    wgmma_commit();
    fence_accumulators(acc);
    wgmma_wait<1>();
    fence_accumulators(acc);
    if (!first && releaser) released.arrive((it - 1) % kStages);
    ++it;
  };
  int s = 0;
  for (; s + 1 < slices; s += 2) slice(a_even, s == 0), slice(a_odd, false);
  if (s < slices) slice(a_even, s == 0);
  wgmma_wait<0>();
  fence_accumulators(acc);
  if (slices > 0 && releaser) released.arrive((it - 1) % kStages);
}

// The wgmma kernels' main loop over k_tiles 64-wide K slices: a kStages-deep pipeline whose copies
// (cp.async, TMA) run kStages - 2 slices ahead. load_slice(k_tile, slot) issues a slice's copies
// into a shared-memory slot (called for k tiles 0, 1, 2, ... in order); landed(k_tile) waits for
// its TMA copies (tma.cuh: SlotBarriers::wait); multiply(slot) issues the slice's wgmmas as one
// committed group (after fence_accumulators and wgmma_fence).
//   - Operands in shared memory: a warpgroup issues slice kt's group, then slice kt + kStages - 2's
//     copies while the tensor cores run it, then waits for group kt - 1. At the next barrier every
//     group up to kt - 1 is done, so the slot the copies then refill (kt - 1's) is free.
//   - kRegisterA (multiply loads A registers): the registers must not change under an in-flight
//     group (ptxas would serialize the wgmmas), so a warpgroup issues the copies first, then waits
//     for group kt - 1, then multiplies; the tensor cores work through kt - 1 meanwhile.
// Returns with every wgmma and copy done and a barrier passed (shared memory may be reused).
template <int kStages, bool kRegisterA = false, typename LoadSlice, typename Landed, typename Multiply>
__device__ __forceinline__ void wgmma_main_loop(int k_tiles, LoadSlice&& load_slice, Landed&& landed,
                                                Multiply&& multiply) {
  constexpr int kAhead = kStages - 2;
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < k_tiles) load_slice(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kAhead - 1>();
    landed(kt);
    fence_proxy_async();
    __syncthreads();  // slice kt landed for all; every warpgroup is done with slice kt - 2's slot
    if constexpr (!kRegisterA) multiply(kt % kStages);
    if (kt + kAhead < k_tiles) load_slice(kt + kAhead, (kt + kAhead) % kStages);
    cp_async_commit();
    if constexpr (kRegisterA) {
      wgmma_wait<0>();
      multiply(kt % kStages);
    } else {
      wgmma_wait<1>();
    }
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
  __syncthreads();
}

}  // namespace cuda
}  // namespace patchgemm
