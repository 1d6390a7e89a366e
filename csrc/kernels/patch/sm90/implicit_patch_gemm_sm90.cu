// Implicit-GEMM patch embedding on Hopper (sm_90a): the GEMM of implicit_patch_gemm.cu, which
// explains the implicit GEMM and its copies, with warpgroup MMAs (wgmma) in place of mma.sync.
// mma.sync reaches about a third of Hopper's tensor-core rate; wgmma runs at the full rate.
//
// A block: 128 tokens x kTileN (128 or 192) embeddings, two warpgroups of 64 tokens each, over a
// kStages-deep pipeline of 64-wide K slices. Each slice's operands land in shared memory as tiles of
// 128-byte rows in the tensor cores' 128B swizzle, which wgmma reads through descriptors:
//   - W [E, K] (B operand): rows are embeddings, K-major; one TMA copy (tma.cuh) per slice, issued
//     by one thread.
//   - patches (A operand), runs of 8, 4 or 2 elements copied by cp.async: rows are tokens, K-major,
//     read the same way.
//   - patches, kw = 2 with pair-major copies (one 16-byte copy moves a pair of 4 tokens): a token's
//     K elements are not contiguous, so A goes through registers. The [pair][token] words are
//     exactly the A fragment's element pairs, so each register is one 32-bit shared load.
// The main loop is wgmma_main_loop (wgmma.cuh): a warpgroup issues a slice's 4 wgmmas as one group,
// which runs while the warpgroup issues later copies.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"
#include "kernels/primitives/tma.cuh"
#include "kernels/primitives/wgmma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;  // two warpgroups
constexpr int kTileM = 128;                             // tokens per block, 64 per warpgroup
constexpr int kTileK = 64;                              // K per slice: one 128-byte swizzled row
constexpr int kStages = 5;
constexpr int kPairPitch = kTileM + 8;                  // pair-major words per pair: conflict-free loads
constexpr int kMaxRuns = 16384;                         // entries of the run-offset table

// Bytes of one pipeline slot: the A tile, then the B tile (both multiples of 1024, the swizzle's
// alignment).
template <int kTileN, bool kPairMajor>
struct Slot {
  static constexpr int kA = kPairMajor ? kTileK / 2 * kPairPitch * 4 : kTileM * 128;
  static constexpr int kB = kTileN * 128;
  static constexpr int kBytes = kA + kB;
  static_assert(kA % 1024 == 0 && kB % 1024 == 0);
};

template <typename T, int kTileN, int V, bool kPairMajor>
__global__ void __launch_bounds__(kThreads, 1)
    implicit_embed_kernel_sm90(Problem p, const T* __restrict__ x, const __grid_constant__ CUtensorMap w_map,
                               const T* __restrict__ bias, bool tokens_out, T* __restrict__ y) {
#ifdef PATCHGEMM_HAS_WGMMA
  using S = Slot<kTileN, kPairMajor>;
  constexpr int kRuns = kTileK / V;                          // runs per token and K slice
  constexpr int kRunGroups = kRuns / 4;                      // lanes: 8 tokens x 4 runs
  constexpr int kLoadsA = kTileM / 8 * kRunGroups / kWarps;  // runs each thread copies per slice
  constexpr int kTokenStep = kWarps / kRunGroups * 8;        // between one thread's tokens (8 | it)
  static_assert(kWarps % kRunGroups == 0 && kLoadsA >= 1);
  static_assert(!kPairMajor || (V == 2 && kRuns % kWarps == 0));
  extern __shared__ unsigned char smem_raw[];
  // Slots from a 1024-byte aligned base (the launch adds the slack), then their barriers, then the
  // tables.
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const SlotBarriers<kStages> w_landed{base + kStages * S::kBytes};
  // [kTileM] (not pair-major)
  int64_t* token_origin = reinterpret_cast<int64_t*>(smem + kStages * S::kBytes + kStages * 8);
  int* run_offset = reinterpret_cast<int*>(token_origin + kTileM);  // [k_tiles * kRuns]; -1: past K

  const int tiles_n = (p.E + kTileN - 1) / kTileN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x / tiles_n) * kTileM;
  const int e0 = static_cast<int>(blockIdx.x % tiles_n) * kTileN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_tiles = (p.ldw + kTileK - 1) / kTileK;

  // Tokens past the end read the last real ones and embeddings past E read zeros (without loads):
  // their results are never stored.
  for (int r = threadIdx.x; r < k_tiles * kRuns; r += kThreads)
    run_offset[r] = r * V < p.K ? patch_offset(p, r * V) : -1;
  if (!kPairMajor && threadIdx.x < kTileM)
    token_origin[threadIdx.x] = patch_origin(p, min(m0 + threadIdx.x, p.rows - 1));
  w_landed.init();
  if (threadIdx.x == 0) prefetch_tensor_map(w_map);
  __syncthreads();

  // A, runs: this thread copies run `run` of every K slice for kLoadsA tokens, kTokenStep apart
  // (a multiple of 8: the same swizzled column for all of them).
  const int run = warp % kRunGroups * 4 + lane / 8, first_token = warp / kRunGroups * 8 + lane % 8;
  const T* a_src[kLoadsA];
#pragma unroll
  for (int i = 0; i < kLoadsA; ++i) a_src[i] = x + token_origin[first_token + i * kTokenStep];
  const uint32_t a_dst = swizzle_128b(first_token, run * V * 2);
  // A, pair-major: this thread copies pairs warp + 8 i of tokens 4 lane .. 4 lane + 3.
  const T* group_src = x + (kPairMajor ? patch_origin(p, min(m0 + 4 * lane, p.rows - 4)) : 0);
  const uint32_t group_dst = (warp * kPairPitch + 4 * lane) * 4;

  auto load_slice = [&](int kt, int slot) {
    const uint32_t slot_base = base + slot * S::kBytes;
    if constexpr (kPairMajor) {
#pragma unroll
      for (int i = 0; i < kRuns / kWarps; ++i) {
        const int offset = run_offset[kt * kRuns + warp + i * kWarps];
        cp_async<16>(slot_base + group_dst + i * kWarps * kPairPitch * 4, group_src + max(offset, 0), offset >= 0);
      }
    } else {
      const int offset = run_offset[kt * kRuns + run];
#pragma unroll
      for (int i = 0; i < kLoadsA; ++i) {
        cp_async<V * 2>(slot_base + a_dst + i * kTokenStep * 128, a_src[i] + max(offset, 0), offset >= 0);
      }
    }
    // B: W's rows e0 .. e0 + kTileN - 1 (rows past E read zeros).
    if (threadIdx.x == 0) tma_load(slot_base + S::kA, w_map, w_landed.arm(slot, S::kB), kt * kTileK, e0);
  };

  // This warp's rows: warpgroup wg's 64 tokens, 16 per warp.
  const int wg = warp / 4, wq = warp % 4;
  // Pair-major A fragments, a0..a3: (token g, pair q), (g + 8, q), (g, q + 4), (g + 8, q + 4).
  const uint32_t* a_words =
      reinterpret_cast<const uint32_t*>(smem) + lane % 4 * kPairPitch + wg * 64 + wq * 16 + lane / 4;
  float acc[kTileN / 2];
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;

  wgmma_main_loop<kStages, kPairMajor>(k_tiles, load_slice, [&](int kt) { w_landed.wait(kt); }, [&](int slot) {
    fence_accumulators(acc);
    const uint32_t slot_base = base + slot * S::kBytes;
    uint32_t af[kTileK / 16][4];
    if constexpr (kPairMajor) {
#pragma unroll
      for (int t = 0; t < kTileK / 16; ++t) {
        const uint32_t* a = a_words + slot * (S::kBytes / 4) + 8 * t * kPairPitch;
        af[t][0] = a[0];
        af[t][1] = a[8];
        af[t][2] = a[4 * kPairPitch];
        af[t][3] = a[4 * kPairPitch + 8];
      }
    }
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kTileK / 16; ++t) {
      const uint64_t desc_b = smem_descriptor_128b(slot_base + S::kA + 32 * t);
      if constexpr (kPairMajor) {
        wgmma_rs<T, kTileN>(acc, af[t], desc_b);
      } else {
        wgmma_ss<T, kTileN>(acc, smem_descriptor_128b(slot_base + wg * 64 * 128 + 32 * t), desc_b);
      }
    }
    wgmma_commit();
    fence_accumulators(acc);
  });
  fence_accumulators(acc);  // the pipeline's shared memory becomes the output stage

  // acc[4 j + 2 half + i]: token wg*64 + wq*16 + g + 8 half, embedding 8 j + 2 q + i.
  const EmbedEpilogue<kTileM, kTileN> epilogue{reinterpret_cast<uint16_t*>(smem), tokens_out};
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
    const int n = j * 8 + 2 * q, e = e0 + n;
    const float bias_lo = bias && e < p.E ? to_float(bias[e]) : 0.f;
    const float bias_hi = bias && e + 1 < p.E ? to_float(bias[e + 1]) : 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      epilogue.put(wg * 64 + wq * 16 + g + half * 8, n,
                   pack2<T>(acc[4 * j + 2 * half] + bias_lo, acc[4 * j + 2 * half + 1] + bias_hi));
    }
  }
  __syncthreads();
  epilogue.template write<kThreads>(p, m0, e0, reinterpret_cast<uint16_t*>(y));
#endif
}

template <typename T, int kTileN, int V, bool kPairMajor = false>
bool launch(const Problem& p, const at::Tensor& x5, const at::Tensor& w, const std::optional<at::Tensor>& bias,
            bool tokens_out, const at::Tensor& y) {
  const int64_t runs = (p.ldw + kTileK - 1) / kTileK * (kTileK / V);
  const int64_t smem = 1024 + kStages * Slot<kTileN, kPairMajor>::kBytes + kStages * 8 + kTileM * 8 + runs * 4;
  static_assert(EmbedEpilogue<kTileM, kTileN>::kBytes <= kStages * Slot<kTileN, kPairMajor>::kBytes);
  if (runs > kMaxRuns || smem > at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) return false;
  CUtensorMap w_map;  // W [E, ldw], a kTileN x 64 box per slice
  const uint64_t dims[2] = {static_cast<uint64_t>(p.ldw), static_cast<uint64_t>(p.E)};
  const uint64_t strides[1] = {static_cast<uint64_t>(p.ldw) * 2};
  const uint32_t box[2] = {kTileK, kTileN};
  if (!encode_tensor_map(w_map, w.const_data_ptr(), 2, dims, strides, box)) return false;
  auto kernel = implicit_embed_kernel_sm90<T, kTileN, V, kPairMajor>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
  const int64_t blocks = (p.rows + kTileM - 1) / kTileM * ((p.E + kTileN - 1) / kTileN);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const T*>(x5.const_data_ptr()), w_map,
      bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr, tokens_out, static_cast<T*>(y.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, int kTileN>
bool launch_for_runs(int run, bool pair_major, const Problem& p, const at::Tensor& x5, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, bool tokens_out, const at::Tensor& y) {
  switch (run) {
    case 8: return launch<T, kTileN, 8>(p, x5, w, bias, tokens_out, y);
    case 4: return launch<T, kTileN, 4>(p, x5, w, bias, tokens_out, y);
    default:
      return pair_major ? launch<T, kTileN, 2, true>(p, x5, w, bias, tokens_out, y)
                        : launch<T, kTileN, 2>(p, x5, w, bias, tokens_out, y);
  }
}

}  // namespace

bool wgmma_kernels_run_here(const at::Tensor& on) {
#ifdef PATCHGEMM_SM90A  // set by the build where it compiles for sm_90a
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(on.get_device());
  return device->major == 9 && device->minor == 0;
#else
  (void)on;
  return false;
#endif
}

bool implicit_embed_sm90(const Problem& p, int run, bool pair_major, const at::Tensor& x5, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias, bool tokens_out, const at::Tensor& y,
                         std::string& why) {
#ifdef PATCHGEMM_SM90A
  // 192-wide tiles where E is a multiple (ViT-B's 768, the hMLP stems' 192), 128 otherwise.
  const bool wide = p.E % 192 == 0;
  bool launched;
  if (x5.scalar_type() == at::kHalf) {
    launched = wide ? launch_for_runs<__half, 192>(run, pair_major, p, x5, w, bias, tokens_out, y)
                    : launch_for_runs<__half, 128>(run, pair_major, p, x5, w, bias, tokens_out, y);
  } else {
    launched = wide ? launch_for_runs<__nv_bfloat16, 192>(run, pair_major, p, x5, w, bias, tokens_out, y)
                    : launch_for_runs<__nv_bfloat16, 128>(run, pair_major, p, x5, w, bias, tokens_out, y);
  }
  return launched || decline(why, "the patch's runs do not fit in shared memory (K too long)");
#else
  return decline(why, "not built for sm_90a");
#endif
}

}  // namespace cuda
}  // namespace patchgemm
