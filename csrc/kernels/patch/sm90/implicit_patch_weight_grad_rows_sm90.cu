// Implicit-GEMM weight gradient on Hopper (sm_90a) with the patches by TMA, tokens grad_y:
//   dW^T [K, E] = P^T [K, B*N] @ grad_y [B*N, E]
// for patch rows of 32, 64 or 128 bytes (kw = 16, 32, 64 16-bit elements: ViT's 16 x 16), read as
// the forward of implicit_patch_gemm_rows_sm90.cu reads them. (The cp.async weight gradient of
// implicit_patch_weight_grad_sm90.cu loses to gather + cuBLAS there.)
//
// A block: 128 patch columns (kh_box = 128 / kw image rows of one channel and patch depth, all kw)
// x 256 embeddings over a range of tokens, the reduction (ranges as implicit_patch_weight_grad.cu
// explains), in slices of 64 tokens. A slice's grad_y is four 64 x 64 boxes of grad_y [B*N, E]
// (N-major, 128B swizzle); its patches are one box per patch-grid row its tokens touch, of x viewed
// as [B*C*D*H image rows][gw][kw]: kh_box image rows of pw = gw rounded up to 8 patch rows (tma.cuh:
// encode_patch_box_map, whose box rows hold up to 128 bytes). A slice's tokens
// sit in those boxes where no descriptor can describe them, so A goes through registers: one
// ldmatrix.trans x4 per 16 tokens, each lane addressing one token's half patch row (8 columns).
//
// Warp-specialized as the forward: one producer warp fills a ring of slots; two consumer
// warpgroups (64 patch columns each) multiply with wgmma m64n256k16 (A from registers, B N-major)
// and release each slot once their next slice's wgmmas are issued. Where the bias gradient is asked
// for, two more warps of the producer's warpgroup sum grad_y rows from shared memory, the blocks of
// the column tiles (which read the same grad_y) a share each: no extra pass over grad_y.
// Blocks write fp32 partial sums (dW [E, K]; dbias [E], two per block); sum_token_ranges.cu adds them
// in a fixed order (deterministic) into the output dtype.
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

constexpr int kConsumers = 256;             // two warpgroups of 64 patch columns
constexpr int kThreads = kConsumers + 128;  // and the producer's warpgroup (warp 0 copies)
constexpr int kTileM = 128;                 // patch columns per block
constexpr int kTileN = 256;                 // embeddings per block
constexpr int kSlice = 64;                  // tokens per slice
constexpr int kDyBox = kSlice * 128;        // a 64-embedding box of a slice's grad_y
constexpr int kSlotDy = kTileN / 64 * kDyBox;  // a slice's grad_y: four boxes

struct Geometry {
  int C, D, H;            // x [B, C, D, H, W], contiguous
  int kd, kh, kw, kh_box;  // the patch; image rows per 128 columns
  int gd, gh, gw, pw;      // patch grid; patches per box (gw rounded up to 8)
  uint32_t gw_magic;       // u / gw = u * gw_magic >> 16 for the u < 64 + gw taken here
  uint32_t swizzle_mask;   // the 16-byte chunk bits the boxes' swizzle flips (patch_box_swizzle_mask)
  int grid_rows;           // B * gd * gh
  int tokens;              // B * N
  int K, E, tiles_m, tiles_n;
  int chunk;               // tokens per range, a multiple of kSlice
  int box_bytes, slot;     // one grid row's box; a slot (grad_y, then up to slot - kSlotDy of boxes)
  bool with_bias;
};

template <typename T, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    implicit_weight_grad_kernel_sm90_rows(Geometry g, const __grid_constant__ CUtensorMap x_map,
                                          const __grid_constant__ CUtensorMap dy_map, float* __restrict__ dw_partial,
                                          float* __restrict__ db_partial) {
#ifdef PATCHGEMM_HAS_WGMMA
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  const int tile_n = static_cast<int>(blockIdx.x) % g.tiles_n,
            tile_m = static_cast<int>(blockIdx.x) / g.tiles_n % g.tiles_m;
  const int split = static_cast<int>(blockIdx.x) / g.tiles_n / g.tiles_m;
  const int e0 = tile_n * kTileN, col0 = tile_m * kTileM;
  const int t_begin = split * g.chunk, t_end = min(t_begin + g.chunk, g.tokens);
  const int slices = (t_end - t_begin + kSlice - 1) / kSlice;

  const SlotBarriers<kStages> landed{base + kStages * g.slot};
  const SlotBarriers<kStages> released{landed.base + kStages * 8};
  landed.init();
  released.init(g.with_bias ? 4 : 2);  // the consumer warpgroups, and the bias warps
  if (threadIdx.x == 0) prefetch_tensor_map(x_map), prefetch_tensor_map(dy_map);
  __syncthreads();
  wait_for_prior_kernels();  // launched dependent (dependent_launch.cuh)

  if (threadIdx.x < kThreads - kConsumers) {
    set_max_registers<40, false>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) {
      // The producer warp, as the forward's: lane i copies grad_y's box i and the slice's grid row
      // i's box of x, one warp instruction for each kind.
      // The block's columns, from a grid row's origin: image rows j0 .. j0 + kh_box - 1 of channel
      // c, patch depth i.
      const int row_blocks = g.kh / g.kh_box, ci = tile_m / row_blocks;
      const int row_offset = (ci / g.kd * g.D + ci % g.kd) * g.H + tile_m % row_blocks * g.kh_box;
      const int last_origin = GridRowCursor(g, g.grid_rows - 1).origin + row_offset;
      const int dy_boxes = min(kTileN, g.E - e0 + 63) / 64;  // boxes past E are not copied (never stored)
      // The slice's first grid row, and its first token's place u0 in it.
      int first = t_begin / g.gw, u0 = t_begin - first * g.gw;
      for (int s = 0; s < slices; ++s) {
        const int boxes = (u0 + kSlice + g.gw - 1) / g.gw;
        released.wait_released(s);
        const uint32_t slot_base = base + s % kStages * g.slot, bar = landed.base + 8 * (s % kStages);
        if (lane == 0) landed.arm(s % kStages, dy_boxes * kDyBox + boxes * g.box_bytes);
        __syncwarp();
        if (lane < dy_boxes) tma_load(slot_base + lane * kDyBox, dy_map, bar, e0 + 64 * lane, t_begin + s * kSlice);
        // Grid rows past the last (the tokens past the end of the last slice) re-read it: finite
        // patches against grad_y's zeros there.
        if (lane < boxes) {
          const int r = first + lane;
          tma_load(slot_base + kSlotDy + lane * g.box_bytes, x_map, bar, 0, 0,
                   r < g.grid_rows ? GridRowCursor(g, r).origin + row_offset : last_origin);
        }
        u0 += kSlice;
        first += u0 / g.gw, u0 %= g.gw;
      }
    } else if (g.with_bias && (warp == 1 || warp == 2)) {
      // The blocks of all column tiles read the same grad_y slices: each sums its share of their
      // rows, tile_m + tiles_m (2 i + warp - 1). Lane: embeddings 8 lane .. 8 lane + 7 of the tile
      // (box lane / 8, 16-byte chunk lane % 8).
      const int row0 = tile_m + g.tiles_m * (warp - 1), row_step = 2 * g.tiles_m;
      float sum[8] = {};
      for (int s = 0; s < slices; ++s) {
        landed.wait(s);
        const uint32_t box = base + s % kStages * g.slot + lane / 8 * kDyBox;
#pragma unroll 2
        for (int r = row0; r < kSlice; r += row_step) {
          uint4 v;
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(box + swizzle_128b(r, lane % 8 * 16)));
          const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum[i] += to_float(e[i]);
        }
        __syncwarp();
        if (lane == 0) released.arrive(s % kStages);
      }
      const int e = e0 + 8 * lane;
      if (e < g.E) {  // E % 8 == 0
        float* out = db_partial + ((int64_t{split} * g.tiles_m + tile_m) * 2 + warp - 1) * g.E + e;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = sum[i];
      }
    }
    return;
  }

  set_max_registers<232, true>();
  const int thread = threadIdx.x - (kThreads - kConsumers);  // among the consumers
  const int wg = thread / 128, wq = thread / 32 % 4, lane = thread % 32, gq = lane / 4, q = lane % 4;
  // ldmatrix.trans rows: this lane's token of each 16-token step, 8 (lane / 16) + lane % 8, and its 8
  // patch columns, the warp's 16 from wg * 64 + wq * 16, the upper 8 for odd lane / 8: image row
  // kh_row of the box, elements kw_col .. kw_col + 7 of its patch row.
  const int token_lane = 8 * (lane / 16) + lane % 8;
  const int m_lane = wg * 64 + wq * 16 + lane / 8 % 2 * 8, kh_row = m_lane / g.kw, kw_col = m_lane % g.kw;
  const uint32_t lane_offset = kSlotDy + (kh_row * g.pw * g.kw + kw_col) * 2;
  int u0 = t_begin % g.gw;                   // the slice's first token's place in its grid row
  const int u_step = kSlice % g.gw;
  float acc[kTileN / 2];
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;
  // ldmatrix.trans addresses of the next slice (its tokens from u0 on), found while the slice before
  // is loaded.
  uint32_t a_offset[kSlice / 16];
  auto find_offsets = [&] {
#pragma unroll
    for (int t = 0; t < kSlice / 16; ++t) {
      const uint32_t u = static_cast<uint32_t>(u0 + 16 * t + token_lane), row = u * g.gw_magic >> 16;
      const uint32_t offset = lane_offset + row * g.box_bytes + (u - row * g.gw) * g.kw * 2;
      a_offset[t] = offset ^ (offset >> 3 & g.swizzle_mask);  // boxes start 1024-byte aligned
    }
    u0 += u_step;
    if (u0 >= g.gw) u0 -= g.gw;
  };
  find_offsets();
  uint32_t a_even[kSlice / 16][4], a_odd[kSlice / 16][4];
  int it = 0;  // slices consumed
  register_a_tile<kStages>(
      acc, a_even, a_odd, slices, it, base, g.slot, landed, released, thread % 128 == 0,
      [&](uint32_t(&af)[kSlice / 16][4], uint32_t slot) {
#pragma unroll
        for (int t = 0; t < kSlice / 16; ++t) ldmatrix_x4_trans(af[t], slot + a_offset[t]);
        find_offsets();
      },
      [&](const uint32_t(&af)[kSlice / 16][4], uint32_t slot) {
#pragma unroll
        for (int t = 0; t < kSlice / 16; ++t) {
          wgmma_rs<T, kTileN, true>(acc, af[t], smem_descriptor_128b(slot + 2048 * t, kDyBox));
        }
      });

  // acc[4 j + 2 half + i]: column col0 + wg*64 + wq*16 + gq + 8 half, embedding e0 + 8 j + 2 q + i.
  // A warp's stores cover 32-byte pieces of 4 rows of dW.
  float* out = dw_partial + int64_t{split} * g.E * g.K + col0 + wg * 64 + wq * 16 + gq;
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int e = e0 + 8 * j + 2 * q + i;
      if (e < g.E) {
        out[int64_t{e} * g.K] = acc[4 * j + i];
        out[int64_t{e} * g.K + 8] = acc[4 * j + 2 + i];
      }
    }
  }
#endif
}

template <typename T, int kStages>
void launch(const Geometry& g, const at::Tensor& x5, const at::Tensor& dy, int splits, const CUtensorMap& x_map,
            const CUtensorMap& dy_map, const at::Tensor& dw, const at::Tensor& db) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor dw_partial = at::empty({splits, g.E, g.K}, x5.options().dtype(at::kFloat));
  const int db_ranges = g.with_bias ? splits * g.tiles_m * 2 : 0;
  const at::Tensor db_partial = at::empty({db_ranges, g.E}, x5.options().dtype(at::kFloat));
  const int smem = 1024 + kStages * g.slot + 2 * kStages * 8;
  auto kernel = implicit_weight_grad_kernel_sm90_rows<T, kStages>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  launch_dependent(kernel, splits * g.tiles_m * g.tiles_n, kThreads, smem, stream, g, x_map, dy_map,
                   dw_partial.data_ptr<float>(), db_partial.data_ptr<float>());
  sum_token_ranges(dw_partial, db_partial, dw, db);
}

template <typename T>
void launch_for_stages(int stages, const Geometry& g, const at::Tensor& x5, const at::Tensor& dy, int splits,
                       const CUtensorMap& x_map, const CUtensorMap& dy_map, const at::Tensor& dw,
                       const at::Tensor& db) {
  switch (stages) {
    case 5: return launch<T, 5>(g, x5, dy, splits, x_map, dy_map, dw, db);
    case 4: return launch<T, 4>(g, x5, dy, splits, x_map, dy_map, dw, db);
    default: return launch<T, 3>(g, x5, dy, splits, x_map, dy_map, dw, db);
  }
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> implicit_weight_grad_rows_sm90(const Problem& p,
                                                                                const at::Tensor& x5,
                                                                                const at::Tensor& dy, bool with_bias,
                                                                                bool ruled, std::string& why) {
#ifdef PATCHGEMM_SM90A
  Geometry g;
  g.kd = p.kd, g.kh = p.kh, g.kw = p.kw;
  if ((g.kw != 16 && g.kw != 32 && g.kw != 64) || g.kh % (kTileM / g.kw)) {
    return decline_grads(why, "kw must be 16, 32 or 64 and kh a multiple of 128 / kw");
  }
  if (p.E % 8 || p.gw > 128) return decline_grads(why, "needs E % 8 == 0 and gw <= 128");
  if (!x5.is_contiguous() || reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % 16 || !dy.is_contiguous() ||
      reinterpret_cast<uintptr_t>(dy.const_data_ptr()) % 16) {
    return decline_grads(why, "x and grad_y must be contiguous and 16-byte aligned");
  }
  if (p.rows == 0) return decline_grads(why, "no patches");
  // Image rows and the past-the-end grid row's origin as ints.
  if (x5.numel() / x5.size(4) >= INT_MAX / 2 || p.rows >= INT_MAX / 2)
    return decline_grads(why, "sizes past 32-bit indices");
  g.kh_box = kTileM / g.kw;
  g.C = static_cast<int>(x5.size(1)), g.D = static_cast<int>(x5.size(2)), g.H = static_cast<int>(x5.size(3));
  g.gw = p.gw, g.gh = p.gh, g.gd = p.tokens / (p.gh * p.gw);
  g.pw = (g.gw + 7) / 8 * 8;
  g.gw_magic = 65536 / g.gw + 1;  // exact for u < 2^16 / gw (u < 64 + gw <= 192 < 512)
  g.swizzle_mask = patch_box_swizzle_mask(g.kw, g.gw);
  g.grid_rows = static_cast<int>(p.rows / g.gw);
  g.tokens = static_cast<int>(p.rows);
  g.K = p.K, g.E = p.E;
  g.tiles_m = p.K / kTileM, g.tiles_n = (p.E + kTileN - 1) / kTileN;
  g.box_bytes = g.pw * 256;  // kh_box x pw x kw 16-bit elements
  const int max_boxes = (g.gw - 1 + kSlice - 1) / g.gw + 1;  // grid rows 64 tokens touch
  // A producer lane each (3 slots of them never fit anyway).
  if (max_boxes > 32) return decline_grads(why, "grid rows too short: a slice would touch over 32 of them");
  g.slot = kSlotDy + max_boxes * g.box_bytes;
  g.with_bias = with_bias;
  const cudaDeviceProp* device = at::cuda::getCurrentDeviceProperties();
  // As many slots as fit, up to 5 (3 at least).
  const int optin = static_cast<int>(device->sharedMemPerBlockOptin);
  int stages = 5;
  while (stages >= 3 && 1024 + stages * (g.slot + 16) > optin) --stages;
  if (stages < 3) return decline_grads(why, "three slots of a slice's boxes do not fit in shared memory");
  // Token ranges: a block per SM, each range at least 8 slices.
  const int64_t tiles = int64_t{g.tiles_m} * g.tiles_n, slices = (p.rows + kSlice - 1) / kSlice;
  const int64_t sms = device->multiProcessorCount;
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>(sms / tiles, slices / 8));
  g.chunk = static_cast<int>((slices + splits - 1) / splits * kSlice);
  // Between half and two thirds of a wave of tiles (ViT-B/32's 72 on 132 SMs), whole ranges leave
  // the other SMs idle. Two unequal ranges instead: the tiles' first two thirds (blocks 0 .. tiles -
  // 1, launched first), then their last thirds, sms - tiles of which start beside them and the rest
  // on the SMs those free, so the wave takes two thirds of the time.
  if (splits == 1 && tiles * 3 <= sms * 2 && slices >= 24) {
    g.chunk = static_cast<int>((2 * slices + 2) / 3 * kSlice);
  }
  splits = (p.rows + g.chunk - 1) / g.chunk;
  if (splits * tiles >= INT_MAX) return decline_grads(why, "too many tiles for 32-bit indices");
  // The rule: blocks for at least 3/4 of the SMs (fewer lose to gather + cuBLAS, which fills the
  // GPU) and at most 6 boxes a slice (grid rows of 13+ patches; more boxes a slice cost more than
  // the gather).
  if (ruled && splits * tiles * 4 < sms * 3) return decline_grads(why, "rule: blocks for under 3/4 of the SMs");
  if (ruled && max_boxes > 6) return decline_grads(why, "rule: over 6 boxes a slice (grid rows under 13 patches)");

  CUtensorMap x_map, dy_map;  // x as [B*C*D*H image rows][gw][kw]; grad_y as [B*N][E]
  const uint64_t dy_dims[2] = {static_cast<uint64_t>(g.E), static_cast<uint64_t>(g.tokens)};
  const uint64_t dy_strides[1] = {static_cast<uint64_t>(g.E) * 2};
  const uint32_t dy_box[2] = {64, kSlice};
  if (!encode_patch_box_map(x_map, x5.const_data_ptr(), x5.numel() / x5.size(4), g.kw, g.gw, g.pw, g.kh_box) ||
      !encode_tensor_map(dy_map, dy.const_data_ptr(), 2, dy_dims, dy_strides, dy_box)) {
    return decline_grads(why, "E's rows are not 16-byte multiples for TMA");
  }
  const at::Tensor dw = at::empty({p.E, p.K}, x5.options());
  const at::Tensor db = with_bias ? at::empty({p.E}, x5.options()) : at::Tensor();
  const int n = static_cast<int>(splits);
  if (x5.scalar_type() == at::kHalf) {
    launch_for_stages<__half>(stages, g, x5, dy, n, x_map, dy_map, dw, db);
  } else {
    launch_for_stages<__nv_bfloat16>(stages, g, x5, dy, n, x_map, dy_map, dw, db);
  }
  return std::make_tuple(dw, db);
#else
  (void)p, (void)x5, (void)dy, (void)with_bias, (void)ruled;
  return decline_grads(why, "not built for sm_90a");
#endif
}

}  // namespace cuda
}  // namespace patchgemm
