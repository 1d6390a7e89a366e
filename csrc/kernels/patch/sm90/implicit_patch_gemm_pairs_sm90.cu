// Implicit-GEMM patch embedding on Hopper (sm_90a) for kw = 2 (the hMLP stems' 2 x 2 x 2 patches:
// P4), channels-first out, with a K slice's patches copied by one TMA box.
//
// A tile is 128 tokens: R = 128 / gw whole rows of the patch grid (gw = 8, 16, 32) in one depth
// plane of one sample. A 64-wide K slice is cs = 32 / (kd * kh) channels' patch rows (c, i, j), a
// pair of elements each; for one (c, i, j) the tile's 128 pairs are R image-row segments of 2 * gw
// elements, kh image rows apart. So x viewed as the 5-D
//   [B*C][D][kh][gh][2 * gw]   (strides D*H*W, H*W, W, kh*W, 1 elements; the grid-row dimension is
//                               outside the row-in-patch one, so the strides need not grow)
// holds a whole slice as one box [cs][kd][kh][R][2 * gw] = [pair][token] 32-bit words: the
// pair-major layout of implicit_patch_gemm_sm90.cu (which builds it with 16-byte cp.async copies, at
// ~430 TFLOP/s on P4), in the swizzle of the box's 4 * gw-byte rows. K's order (c, i, j, kw) is W's.
//
// A goes through registers (a token's K elements are not contiguous). The warp's MMA rows g and
// g + 8 are its tokens 2g and 2g + 1, so a lane's A fragment (rows g, g + 8 of pairs q and q + 4)
// is two 64-bit shared loads, and the staged output [E][tokens] takes a packed pair of tokens per
// store.
//
// Persistent and warp-specialized as implicit_patch_gemm_rows_sm90.cu: one producer thread copies
// each slice (x's box, W's kTileN x 64 box) into a ring of slots; two consumer warpgroups (64 tokens
// each) multiply with wgmma (A from registers, B by descriptor), stage the tile (bias added) in
// shared memory, and one thread stores it to y [B, E, N] by TMA while the next tile's slices land.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/primitives/dependent_launch.cuh"
#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"
#include "kernels/primitives/tma.cuh"
#include "kernels/primitives/wgmma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kConsumers = 256;             // two warpgroups of 64 tokens
constexpr int kThreads = kConsumers + 128;  // and the producer's warpgroup (thread 0 copies)
constexpr int kTileM = 128;                 // tokens per tile
constexpr int kTileK = 64;                  // K per slice: 32 pairs
constexpr int kSlotX = kTileM * kTileK * 2;  // a slice's patches: [32 pairs][128 tokens] words
constexpr int kStages = 4;

// Shared memory: kStages slots (W's kTileN x 64 box, then x's box), the output stage (two halves of
// 64 tokens: [kTileN embeddings][128 bytes], 128B swizzle), then the barriers.
template <int kTileN>
struct Layout {
  static constexpr int kSlotW = kTileN * 128;
  static constexpr int kSlot = kSlotW + kSlotX;
  static constexpr int kStageHalf = kTileN * 128;
  static constexpr int kBytes = 1024 + kStages * kSlot + 2 * kStageHalf + 2 * kStages * 8;
  static_assert(kSlotW % 1024 == 0 && kSlot % 1024 == 0);
};

struct Geometry {
  PairTiles tiles_m;  // where a tile's tokens are
  int C, cs, kd, kh;  // channels; channels per K slice; the patch's depth and height
  int k_tiles, E, tiles_n, tiles;
};

template <typename T, int kTileN>
__global__ void __launch_bounds__(kThreads, 1)
    implicit_embed_kernel_sm90_pairs(Geometry g, const __grid_constant__ CUtensorMap x_map,
                                     const __grid_constant__ CUtensorMap w_map,
                                     const __grid_constant__ CUtensorMap y_map, const T* __restrict__ bias) {
#ifdef PATCHGEMM_HAS_WGMMA
  using L = Layout<kTileN>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  const uint32_t stage = base + kStages * L::kSlot;
  const SlotBarriers<kStages> landed{stage + 2 * L::kStageHalf};
  const SlotBarriers<kStages> released{landed.base + kStages * 8};
  landed.init();
  released.init(2);  // one arrival per consumer warpgroup
  if (threadIdx.x == 0) prefetch_tensor_map(x_map), prefetch_tensor_map(w_map), prefetch_tensor_map(y_map);
  __syncthreads();
  wait_for_prior_kernels();  // launched dependent (dependent_launch.cuh)

  if (threadIdx.x < kThreads - kConsumers) {
    set_max_registers<40, false>();
    if (threadIdx.x != 0) return;
    int it = 0;  // slices copied, over all of this block's tiles
    for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
      const PairTiles::Origin o = g.tiles_m.origin(tile / g.tiles_n);
      const int e0 = tile % g.tiles_n * kTileN, d0 = o.z * g.kd, bc0 = o.b * g.C;
      for (int kt = 0; kt < g.k_tiles; ++kt, ++it) {
        released.wait_released(it);
        const int slot = it % kStages;
        const uint32_t slot_base = base + slot * L::kSlot, bar = landed.arm(slot, L::kSlot);
        tma_load(slot_base, w_map, bar, kt * kTileK, e0);
        tma_load(slot_base + L::kSlotW, x_map, bar, 0, o.y0, 0, d0, bc0 + kt * g.cs);
      }
    }
    return;
  }

  set_max_registers<232, true>();
  const int thread = threadIdx.x - (kThreads - kConsumers);  // among the consumers
  const int wg = thread / 128, wq = thread / 32 % 4, lane = thread % 32, gq = lane / 4, q = lane % 4;
  const int token = wg * 64 + wq * 16 + 2 * gq;  // MMA row gq; row gq + 8 is token + 1
  // The A fragment of K step t: pairs 8t + q (a0, a1) and 8t + q + 4 (a2, a3), tokens token and
  // token + 1 each: one 64-bit load per pair.
  uint32_t a_offset[kTileK / 16][2];
#pragma unroll
  for (int t = 0; t < kTileK / 16; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) a_offset[t][h] = L::kSlotW + pair_box_offset(8 * t + q + 4 * h, token, g.tiles_m.gw);
  }
  float acc[kTileN / 2];
  uint32_t a_even[kTileK / 16][4], a_odd[kTileK / 16][4];
  int it = 0;  // slices consumed
  for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const PairTiles::Origin o = g.tiles_m.origin(tile / g.tiles_n);
    const int e0 = tile % g.tiles_n * kTileN;
#pragma unroll
    for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;
    register_a_tile<kStages>(
        acc, a_even, a_odd, g.k_tiles, it, base, L::kSlot, landed, released, thread % 128 == 0,
        [&](uint32_t(&af)[kTileK / 16][4], uint32_t slot) {
#pragma unroll
          for (int t = 0; t < kTileK / 16; ++t) {
            const uint2 lo = ld_shared_v2(slot + a_offset[t][0]), hi = ld_shared_v2(slot + a_offset[t][1]);
            af[t][0] = lo.x, af[t][1] = lo.y, af[t][2] = hi.x, af[t][3] = hi.y;
          }
        },
        [&](const uint32_t(&af)[kTileK / 16][4], uint32_t slot) {
#pragma unroll
          for (int t = 0; t < kTileK / 16; ++t) wgmma_rs<T, kTileN>(acc, af[t], smem_descriptor_128b(slot + 32 * t));
        });

    // The stage is free once the previous tile's stores have read it.
    if (thread == 0) tma_store_wait_read();
    named_barrier_sync(1, kConsumers);
    // acc[4 j + 2 half + i]: MMA row gq + 8 half (token + half), embedding 8 j + 2 q + i; the stage
    // half token / 64 holds row (embedding) n, tokens in 128 bytes.
    const uint32_t to = stage + token / 64 * L::kStageHalf;
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n = 8 * j + 2 * q + i;
        const float bias_n = bias && e0 + n < g.E ? to_float(bias[e0 + n]) : 0.f;
        st_shared(to + swizzle_128b(n, token % 64 * 2), pack2<T>(acc[4 * j + i] + bias_n, acc[4 * j + 2 + i] + bias_n));
      }
    }
    fence_proxy_async();  // the stage's writes, visible to the TMA stores
    named_barrier_sync(1, kConsumers);
    if (thread == 0) {  // embeddings past E are not written
      tma_store(y_map, stage, o.n0, e0, o.b);
      tma_store(y_map, stage + L::kStageHalf, o.n0 + 64, e0, o.b);
      tma_store_commit();
    }
  }
  if (thread == 0) tma_store_wait();
#endif
}

template <typename T, int kTileN>
bool launch(const Geometry& g, const at::Tensor& x5, const at::Tensor& w, const std::optional<at::Tensor>& bias,
            const at::Tensor& y) {
  using L = Layout<kTileN>;
  if (L::kBytes > static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin)) return false;
  const uint64_t N = static_cast<uint64_t>(g.tiles_m.per_sample) * kTileM;
  CUtensorMap x_map, w_map, y_map;
  const uint64_t K = static_cast<uint64_t>(g.k_tiles) * kTileK, E = g.E;
  const uint64_t w_dims[2] = {K, E}, w_strides[1] = {K * 2};
  const uint32_t w_box[2] = {kTileK, kTileN};
  // y as [B][E][N], a box of 64 tokens x kTileN embeddings (the stage's halves).
  const uint64_t y_dims[3] = {N, E, static_cast<uint64_t>(x5.size(0))}, y_strides[2] = {N * 2, E * N * 2};
  const uint32_t y_box[3] = {64, kTileN, 1};
  if (!encode_pair_box_map(x_map, x5.const_data_ptr(), x5.size(0) * g.C, x5.size(2), x5.size(3), x5.size(4), g.kd,
                           g.kh, g.cs) ||
      !encode_tensor_map(w_map, w.const_data_ptr(), 2, w_dims, w_strides, w_box) ||
      !encode_tensor_map(y_map, y.data_ptr(), 3, y_dims, y_strides, y_box)) {
    return false;
  }
  auto kernel = implicit_embed_kernel_sm90_pairs<T, kTileN>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), L::kBytes);
  const int blocks = std::min(g.tiles, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  launch_dependent(kernel, blocks, kThreads, L::kBytes, at::cuda::getCurrentCUDAStream(), g, x_map, w_map, y_map,
                   bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr);
  return true;
}

}  // namespace

namespace {

// The kernel's geometry for p, or false with the reason where it does not apply (the launch still
// checks shared memory).
bool pairs_geometry(const Problem& p, const at::Tensor& x5, Geometry& g, std::string& why) {
  if (!pair_tiles_fit(p)) return decline(why, "needs kw = 2, gw of 8, 16 or 32 and gh a multiple of 128 / gw");
  if (32 % (p.kd * p.kh) || p.E % 8) return decline(why, "needs kd * kh dividing 32 and E % 8 == 0");
  if (!x5.is_contiguous() || reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % 16) {
    return decline(why, "x must be contiguous and 16-byte aligned");
  }
  g.C = static_cast<int>(x5.size(1)), g.cs = 32 / (p.kd * p.kh);
  // Whole slices of channels (so K % 64 == 0 and W's rows need no padding).
  if (g.C % g.cs) return decline(why, "C must be a multiple of 32 / (kd * kh)");
  g.tiles_m = pair_tiles(p);
  g.kd = p.kd, g.kh = p.kh;
  g.k_tiles = p.K / kTileK;
  g.E = p.E;
  const bool wide = p.E % 192 == 0;  // 192-wide tiles where E is a multiple (the stems' 192), 128 otherwise
  g.tiles_n = (p.E + (wide ? 191 : 127)) / (wide ? 192 : 128);
  const int64_t tiles = p.rows / kTileM * g.tiles_n;
  if (tiles >= INT_MAX || x5.size(0) * g.C >= INT_MAX) return decline(why, "too many tiles for 32-bit indices");
  g.tiles = static_cast<int>(tiles);
  return true;
}

}  // namespace

bool implicit_embed_pairs_sm90_fits(const Problem& p, const at::Tensor& x5, std::string& why) {
#ifdef PATCHGEMM_SM90A
  Geometry g;
  return pairs_geometry(p, x5, g, why);
#else
  (void)p, (void)x5;
  return decline(why, "not built for sm_90a");
#endif
}

bool implicit_embed_pairs_sm90(const Problem& p, const at::Tensor& x5, const at::Tensor& w,
                               const std::optional<at::Tensor>& bias, const at::Tensor& y, std::string& why) {
#ifdef PATCHGEMM_SM90A
  Geometry g;
  if (!pairs_geometry(p, x5, g, why)) return false;
  const bool wide = p.E % 192 == 0;
  bool launched;
  if (y.scalar_type() == at::kHalf) {
    launched = wide ? launch<__half, 192>(g, x5, w, bias, y) : launch<__half, 128>(g, x5, w, bias, y);
  } else {
    launched = wide ? launch<__nv_bfloat16, 192>(g, x5, w, bias, y) : launch<__nv_bfloat16, 128>(g, x5, w, bias, y);
  }
  return launched || decline(why, "its tiles do not fit in shared memory");
#else
  (void)p, (void)x5, (void)w, (void)bias, (void)y;
  return decline(why, "not built for sm_90a");
#endif
}

}  // namespace cuda
}  // namespace patchgemm
