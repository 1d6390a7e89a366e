// Implicit-GEMM patch embedding on Hopper (sm_90a) for wide patch rows, tokens out: the GEMM of
// implicit_patch_gemm_sm90.cu with the patches copied by TMA, a whole patch-grid row per copy.
//
// Where a patch row is 16, 32, 64 or 128 bytes (kw = 8, 16, 32, 64 16-bit elements: ViT's 16 x 16
// patches) and x is contiguous channels-first, the patches' part of one 64-wide K slice for a row of
// the patch grid is one box of x: kh_box = 64 / kw image rows of pw patch rows (gw rounded up to 8;
// the rest reads zeros), landing as [kh_box][pw][kw] (tma.cuh: encode_patch_box_map, whose box rows
// hold up to 128 bytes of neighbouring patches, fewer and wider copies than one patch row per box
// row). Where kw = 16, or kw = 8 and gw is odd (16-byte box rows), and an
// image row is at most 256 elements, the box is instead kh_box whole image rows, unswizzled, with pw
// = gw (kw = 16: 4 rows of up to 512 bytes instead of 32 of 64, worth ldmatrix's 2-way bank conflicts
// on 32-byte patch rows). TMA frees the warps from the copies' address arithmetic, which bounds the
// cp.async forward.
//
// A tile's tokens are R whole grid rows (R * gw <= 128: 126 of ViT-B/16's 14-patch rows), so each
// MMA row reads a fixed place in one of the tile's R boxes. Those rows do not form the uniform 8-row
// groups a wgmma descriptor describes, so A goes through registers: ldmatrix from per-lane row
// addresses, one x4 per 16-wide K step.
//
// Persistent and warp-specialized as the unembedding (implicit_patch_unembed_sm90.cu): a block per
// SM walks tiles of R grid rows x 256 embeddings. One producer warp copies each slice (R boxes of
// x, one 256 x 64 box of W [E, K]) into a kStages-deep ring; two consumer warpgroups (64 MMA rows
// each) multiply with wgmma m64n256k16; each stages its 64 rows (bias added) in shared memory, a
// 64-embedding block at a time, and one of its threads stores them to y [B*N, E] by TMA, while the
// producer already copies the next tile's slices. Where shared memory allows, each warpgroup has two
// stage blocks, so staging a block waits only for the store of the one before the last. The tile's bias values are
// copied to shared memory when its MMAs start, so the epilogue does not wait on global loads.
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

constexpr int kConsumers = 256;             // two warpgroups of 64 MMA rows
constexpr int kThreads = kConsumers + 128;  // and the producer's warpgroup (warp 0 copies)
constexpr int kTileM = 128;                 // MMA rows; the tile's R * gw tokens are the first
constexpr int kTileN = 256;                 // embeddings per tile
constexpr int kTileK = 64;                  // K per slice: kh_box image rows of kw
constexpr int kMaxBoxes = 32;               // x copies per slice (grid rows per tile): a producer lane each
constexpr int kMaxBoxRows = 160;            // R x pw: at most 20 KB of x per slice
// 4 slots of 48-52 KB and the output stage fill shared memory (ViT-B/16's 48 KB slots leave room for
// 2 stage blocks per warpgroup); more slots beat a stage for the whole tile.
constexpr int kStages = 4;
constexpr int kSlotW = kTileN * kTileK * 2;
// The output stage: one or two blocks of 64 rows x 64 embeddings (128 bytes, 128B swizzle) per
// consumer warpgroup, which stages and stores its rows' 4 blocks in turn.
constexpr int kStageBlock = 64 * 128;
constexpr int kBiasBytes = kTileN * 2;  // a tile's bias values (a copy per consumer warpgroup)

struct Geometry {
  int C, D, H;             // x [B, C, D, H, W], contiguous
  int kd, kh, kw, kh_box;  // the patch; image rows per K slice
  int gd, gh, gw, pw;      // patch grid; patches per box (gw rounded up to 8, or gw for whole rows)
  bool whole_rows;         // kw = 16 or (kw = 8, gw odd), and W <= 256: boxes of whole image rows
  uint32_t swizzle_mask;   // the 16-byte chunk bits that the boxes' swizzle flips (patch_box_swizzle_mask)
  int grid_rows;           // B * gd * gh
  int rows_per_tile;       // R
  int k_tiles, E, tiles_n, tiles;
  int slot, copied;        // bytes of a slot (W's 256 x 64 tile, then x's boxes) and copied into it
};

// kStageBlocks: output stage blocks per consumer warpgroup, 2 where shared memory allows, or 1.
template <typename T, int kStageBlocks>
__global__ void __launch_bounds__(kThreads, 1)
    implicit_embed_kernel_sm90_rows(Geometry g, const __grid_constant__ CUtensorMap x_map,
                                    const __grid_constant__ CUtensorMap w_map,
                                    const __grid_constant__ CUtensorMap y_lo, const __grid_constant__ CUtensorMap y_hi,
                                    const T* __restrict__ bias) {
#ifdef PATCHGEMM_HAS_WGMMA
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  const uint32_t stage = base + kStages * g.slot;
  const SlotBarriers<kStages> landed{stage + 2 * kStageBlocks * kStageBlock};
  const SlotBarriers<kStages> released{landed.base + kStages * 8};
  const uint32_t bias_stage = released.base + kStages * 8;
  landed.init();
  released.init(2);  // one arrival per consumer warpgroup
  if (threadIdx.x == 0) {
    prefetch_tensor_map(x_map), prefetch_tensor_map(w_map), prefetch_tensor_map(y_lo), prefetch_tensor_map(y_hi);
  }
  __syncthreads();
  wait_for_prior_kernels();  // launched dependent (dependent_launch.cuh)
  const int box_bytes = g.pw * 128;  // grid row s's box, [kh_box][pw][kw], from s * box_bytes

  if (threadIdx.x < kThreads - kConsumers) {
    set_max_registers<40, false>();
    if (threadIdx.x >= 32) return;
    // The producer warp: lane s copies grid row s's box of each slice, lane 0 also W's, so one warp
    // instruction issues all R box copies. (One thread issuing them one by one, their origins in a
    // local array, is what the pipeline would wait on.) A copy
    // may complete before lane 0 arms the slot: its bytes only take the barrier's transaction count
    // below zero for a moment, and the phase waits for lane 0's arrival as well.
    const int lane = threadIdx.x;
    int it = 0;  // slices copied, over all of this block's tiles
    for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
      const int row0 = tile / g.tiles_n * g.rows_per_tile, e0 = tile % g.tiles_n * kTileN;
      // Rows past the last grid row re-read it (never stored).
      const int origin = GridRowCursor(g, min(row0 + lane, g.grid_rows - 1)).origin;
      // Slice kt's image rows from the origins: (channel c, patch depth i, row block jb), jb fastest.
      int offset = 0, jb = 0, i = 0;
      for (int kt = 0; kt < g.k_tiles; ++kt, ++it) {
        released.wait_released(it);
        const int slot = it % kStages;
        const uint32_t slot_base = base + slot * g.slot, bar = landed.base + 8 * slot;
        if (lane == 0) landed.arm(slot, g.copied), tma_load(slot_base, w_map, bar, kt * kTileK, e0);
        if (lane < g.rows_per_tile) tma_load(slot_base + kSlotW + lane * box_bytes, x_map, bar, 0, 0, origin + offset);
        offset += g.kh_box;
        if (++jb * g.kh_box == g.kh) {
          jb = 0, offset += g.H - g.kh;
          if (++i == g.kd) i = 0, offset += (g.D - g.kd) * g.H;
        }
      }
    }
    return;
  }

  set_max_registers<232, true>();
  const int thread = threadIdx.x - (kThreads - kConsumers);  // among the consumers
  const int wg = thread / 128, wq = thread / 32 % 4, lane = thread % 32, q = lane % 4;
  const int tokens_per_tile = g.rows_per_tile * g.gw;
  // ldmatrix rows: this lane's MMA row (its warp's 16 rows, lanes 16-31 the upper 8 K of each step),
  // as grid row s, patch p of the tile; at K step t, element kk of the slice is row kk / kw,
  // element kk % kw of box s. Rows past the tile's tokens read token 0 (their results are never
  // stored).
  uint32_t a_offset[kTileK / 16];
  {
    const int m = wg * 64 + wq * 16 + lane % 16, token = m < tokens_per_tile ? m : 0;
    const int s = token / g.gw, p = token % g.gw;
#pragma unroll
    for (int t = 0; t < kTileK / 16; ++t) {
      const int kk = 16 * t + 8 * (lane / 16);
      const uint32_t offset = kSlotW + s * box_bytes + ((kk / g.kw * g.pw + p) * g.kw + kk % g.kw) * 2;
      a_offset[t] = offset ^ (offset >> 3 & g.swizzle_mask);  // boxes start 1024-byte aligned
    }
  }
  // The upper warpgroup's 64 MMA rows hold no tokens where a tile has 64 or fewer (grid rows of 1-3
  // patches): it multiplies, to keep the slot barriers' count, but stages and stores nothing.
  const bool has_rows = wg * 64 < tokens_per_tile;
  int staged = 0;  // blocks this warpgroup has staged (and stored), over all of its tiles
  float acc[kTileN / 2];
  uint32_t a_even[kTileK / 16][4], a_odd[kTileK / 16][4];
  int it = 0;  // slices consumed
  for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const int row0 = tile / g.tiles_n * g.rows_per_tile, e0 = tile % g.tiles_n * kTileN;
#pragma unroll
    for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;
    // This warpgroup's copy of the tile's bias values, a pair per thread, lands during the MMAs.
    // (Its reads of the previous tile's all came before that epilogue's last barrier.) Loaded
    // from global memory in the epilogue, a block at a time, the epilogue would wait on them.
    const uint32_t my_bias = bias_stage + wg * kBiasBytes;
    if (bias && has_rows) {
      const int e = e0 + 2 * (thread % 128);  // E % 8 == 0: e + 1 < E too
      cp_async<4>(my_bias + 4 * (thread % 128), e < g.E ? bias + e : bias, e < g.E);
      cp_async_commit();
    }
    register_a_tile<kStages>(
        acc, a_even, a_odd, g.k_tiles, it, base, g.slot, landed, released, thread % 128 == 0,
        [&](uint32_t(&af)[kTileK / 16][4], uint32_t slot) {
#pragma unroll
          for (int t = 0; t < kTileK / 16; ++t) ldmatrix_x4(af[t], slot + a_offset[t]);
        },
        [&](const uint32_t(&af)[kTileK / 16][4], uint32_t slot) {
#pragma unroll
          for (int t = 0; t < kTileK / 16; ++t) wgmma_rs<T, kTileN>(acc, af[t], smem_descriptor_128b(slot + 32 * t));
        });

    // Each warpgroup stages and stores its own 64 rows, with no barrier across the two: one's
    // epilogue overlaps the other's MMAs. acc[4 j + 2 half + i]: MMA row wg*64 +
    // wq*16 + lane / 4 + 8 half, embedding 8 j + 2 q + i.
    //
    // Invariant: every block staged is stored and committed, and the stage blocks are taken in
    // turn over the warpgroup's tiles (staged % kStageBlocks), so the kStageBlocks - 1 stores
    // tma_store_wait_read lets stay in flight never read the stage block about to be written. A
    // block staged but not stored (past E, or a warpgroup with no tokens) would commit nothing and
    // let the wait pass while the store that last read that stage still reads it; a count
    // restarting at each tile would, after an odd number of blocks, write the block the last
    // store reads. Blocks past E are skipped whole (a condition uniform over the warpgroup, so its
    // named barriers stay matched).
    if (!has_rows) continue;
    const int blocks = min(kTileN / 64, (g.E - e0 + 63) / 64);
    const bool storer = thread % 128 == 0;
    const uint32_t my_stage = stage + wg * kStageBlocks * kStageBlock;
#pragma unroll
    for (int b = 0; b < kTileN / 64; ++b) {
      if (b >= blocks) break;
      // Block b's stage is free once the store that last used it has read it.
      if (storer) tma_store_wait_read<kStageBlocks - 1>();
      const uint32_t block_stage = my_stage + staged++ % kStageBlocks * kStageBlock;
      if (b == 0 && bias) cp_async_wait<0>();  // this thread's bias pair (the barrier: everyone's)
      named_barrier_sync(1 + wg, 128);
      float bias_lo[8] = {}, bias_hi[8] = {};
      if (bias) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
          unpack2<T>(ld_shared(my_bias + (64 * b + 8 * jj + 2 * q) * 2), bias_lo[jj], bias_hi[jj]);
      }
      // Four 8 x 8 matrices per stmatrix: rows +0 and +8 of embeddings 8 jj and 8 (jj + 1); lane l
      // gives row l % 8 of matrix l / 8.
#pragma unroll
      for (int jj = 0; jj < 8; jj += 2) {
        uint32_t v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int j = 8 * b + jj + m / 2, half = m % 2;
          v[m] = pack2<T>(acc[4 * j + 2 * half] + bias_lo[jj + m / 2], acc[4 * j + 2 * half + 1] + bias_hi[jj + m / 2]);
        }
        const int mi = lane / 8;
        stmatrix_x4(block_stage + swizzle_128b(wq * 16 + 8 * (mi % 2) + lane % 8, (jj + mi / 2) * 16), v);
      }
      fence_proxy_async();  // the stage's writes, visible to the TMA store
      named_barrier_sync(1 + wg, 128);
      // Rows past the tensor are not written (the TMA store clips them).
      if (storer) {
        tma_store(wg == 0 ? y_lo : y_hi, block_stage, e0 + 64 * b, row0 * g.gw + wg * 64);
        tma_store_commit();
      }
    }
  }
  if (thread % 128 == 0) tma_store_wait();
#endif
}

template <typename T>
bool launch(const Geometry& g, const at::Tensor& x5, const at::Tensor& w, const std::optional<at::Tensor>& bias,
            const at::Tensor& y) {
  const int64_t rows = x5.numel() / x5.size(4);  // image rows, B*C*D*H
  const int64_t tokens = static_cast<int64_t>(g.grid_rows) * g.gw;
  if (rows >= INT_MAX || tokens >= INT_MAX) return false;
  // The bias is copied 4 bytes at a time: a view that starts mid-pair takes another kernel.
  if (bias && reinterpret_cast<uintptr_t>(bias->const_data_ptr()) % 4) return false;
  const int most = static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  const auto smem_for = [&](int stage_blocks) {
    return 1024 + kStages * g.slot + 2 * stage_blocks * kStageBlock + 2 * kStages * 8 + 2 * kBiasBytes;
  };
  const int stage_blocks = smem_for(2) <= most ? 2 : 1, smem = smem_for(stage_blocks);
  if (smem > most) return false;
  CUtensorMap x_map, w_map, y_lo, y_hi;  // x as [B*C*D*H image rows][gw][kw]
  // Whole rows: x as [image rows][1][W], a box of kh_box rows; the same coordinates (0, 0, row).
  const uint64_t row_bytes = static_cast<uint64_t>(g.gw) * g.kw * 2;
  const uint64_t row_dims[3] = {row_bytes / 2, 1, static_cast<uint64_t>(rows)}, row_strides[2] = {row_bytes, row_bytes};
  const uint32_t row_box[3] = {static_cast<uint32_t>(g.gw * g.kw), 1, static_cast<uint32_t>(g.kh_box)};
  const uint64_t K = static_cast<uint64_t>(g.k_tiles) * kTileK, E = g.E;
  const uint64_t w_dims[2] = {K, E}, w_strides[1] = {K * 2};
  const uint32_t w_box[2] = {kTileK, kTileN};
  const uint64_t y_dims[2] = {E, static_cast<uint64_t>(tokens)}, y_strides[1] = {E * 2};
  // Each consumer warpgroup stores its rows of the tile: the first 64 tokens, the rest (if any).
  const int tokens_per_tile = g.rows_per_tile * g.gw;
  const uint32_t lo_box[2] = {64, static_cast<uint32_t>(std::min(tokens_per_tile, 64))};
  const uint32_t hi_box[2] = {64, static_cast<uint32_t>(std::max(tokens_per_tile - 64, 1))};
  if (!(g.whole_rows ? encode_tensor_map(x_map, x5.const_data_ptr(), 3, row_dims, row_strides, row_box,
                                       CU_TENSOR_MAP_SWIZZLE_NONE)
                    : encode_patch_box_map(x_map, x5.const_data_ptr(), rows, g.kw, g.gw, g.pw, g.kh_box)) ||
      !encode_tensor_map(w_map, w.const_data_ptr(), 2, w_dims, w_strides, w_box) ||
      !encode_tensor_map(y_lo, y.data_ptr(), 2, y_dims, y_strides, lo_box) ||
      !encode_tensor_map(y_hi, y.data_ptr(), 2, y_dims, y_strides, hi_box)) {
    return false;
  }
  auto kernel = stage_blocks == 2 ? implicit_embed_kernel_sm90_rows<T, 2> : implicit_embed_kernel_sm90_rows<T, 1>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  const int blocks = std::min(g.tiles, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  launch_dependent(kernel, blocks, kThreads, smem, at::cuda::getCurrentCUDAStream(), g, x_map, w_map, y_lo, y_hi,
                   bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr);
  return true;
}

// The kernel's geometry for p, or false with the reason where it does not apply (the launch still
// checks shared memory and 32-bit row indices).
bool rows_geometry(const Problem& p, const at::Tensor& x5, bool ruled, Geometry& g, std::string& why) {
  g.kd = p.kd, g.kh = p.kh, g.kw = p.kw;
  if ((g.kw != 8 && g.kw != 16 && g.kw != 32 && g.kw != 64) || g.kh % (kTileK / g.kw)) {
    return decline(why, "kw must be 8, 16, 32 or 64 and kh a multiple of 64 / kw");
  }
  if (p.K % kTileK || p.E % 8 || p.gw > kTileM) return decline(why, "needs K % 64 == 0, E % 8 == 0, gw <= 128");
  if (!x5.is_contiguous() || reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % 16) {
    return decline(why, "x must be contiguous and 16-byte aligned");
  }
  g.kh_box = kTileK / g.kw;
  g.C = static_cast<int>(x5.size(1)), g.D = static_cast<int>(x5.size(2)), g.H = static_cast<int>(x5.size(3));
  g.gw = p.gw, g.gh = p.gh, g.gd = p.tokens / (p.gh * p.gw);
  g.whole_rows = (g.kw == 16 || (g.kw == 8 && patches_per_box_row(g.kw, g.gw) == 1)) && g.gw * g.kw <= 256;
  g.pw = g.whole_rows ? g.gw : (g.gw + 7) / 8 * 8;
  if (p.rows / g.gw >= INT_MAX) return decline(why, "too many grid rows for 32-bit indices");
  g.grid_rows = static_cast<int>(p.rows / g.gw);
  g.rows_per_tile = std::min({kTileM / g.gw, kMaxBoxRows / g.pw, kMaxBoxes});
  // Tiles of fewer tokens leave MMA rows idle: below 3 / 4 of them the other kernels are faster.
  if (ruled && g.rows_per_tile * g.gw < kTileM * 3 / 4) {
    return decline(why, "rule: grid rows fill under 3/4 of a 128-token tile");
  }
  g.k_tiles = p.K / kTileK;
  g.E = p.E;
  g.tiles_n = (p.E + kTileN - 1) / kTileN;
  const int64_t tiles = (g.grid_rows + static_cast<int64_t>(g.rows_per_tile) - 1) / g.rows_per_tile * g.tiles_n;
  if (tiles >= INT_MAX) return decline(why, "too many tiles for 32-bit indices");
  g.tiles = static_cast<int>(tiles);
  g.swizzle_mask = g.whole_rows ? 0 : patch_box_swizzle_mask(g.kw, g.gw);  // whole rows: unswizzled
  g.copied = kSlotW + g.rows_per_tile * g.pw * 128;
  g.slot = (g.copied + 1023) / 1024 * 1024;
  return true;
}

}  // namespace

bool implicit_embed_rows_sm90_fits(const Problem& p, const at::Tensor& x5, bool ruled, std::string& why) {
#ifdef PATCHGEMM_SM90A
  Geometry g;
  return rows_geometry(p, x5, ruled, g, why);
#else
  (void)p, (void)x5, (void)ruled;
  return decline(why, "not built for sm_90a");
#endif
}

bool implicit_embed_rows_sm90(const Problem& p, const at::Tensor& x5, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias, const at::Tensor& y, bool ruled,
                              std::string& why) {
#ifdef PATCHGEMM_SM90A
  Geometry g;
  if (!rows_geometry(p, x5, ruled, g, why)) return false;
  const bool launched =
      y.scalar_type() == at::kHalf ? launch<__half>(g, x5, w, bias, y) : launch<__nv_bfloat16>(g, x5, w, bias, y);
  return launched || decline(why, "x past 32-bit row indices, a bias not 4-byte aligned, or tiles past shared memory");
#else
  (void)p, (void)x5, (void)w, (void)bias, (void)y, (void)ruled;
  return decline(why, "not built for sm_90a");
#endif
}

}  // namespace cuda
}  // namespace patchgemm
