// Implicit-GEMM patch unembedding on Hopper (sm_90a), kw = 2, 4 or a multiple of 8: the GEMM of
// implicit_patch_unembed.cu, which explains it (tokens x patch columns x C_in, the output tile
// scattered into y from the epilogue), with warpgroup MMAs (wgmma) in place of mma.sync, as the
// forward's implicit_patch_gemm_sm90.cu. A patch row of y is a run of kw elements, and the runs of
// consecutive tokens are adjacent: the epilogue stores 16 bytes = the runs of 8 / kw tokens. Where
// kw % 8 == 0 (channels-last y's rows of kw * C elements are: patch_geometry.h, channels_first_view) it
// stores 8 elements of one token's row instead, a warp's lanes along the row.
//
// Persistent and warp-specialized, because the GEMM is short (C_in: 3 to 24 slices) and its output
// large (y is 8x to 64x x): a block per SM walks tiles of 128 tokens x 192 patch columns. One
// producer thread copies 64-channel slices by TMA (tma.cuh) into a kStages-deep ring of slots,
// running ahead across tiles; two consumer warpgroups (64 tokens each) multiply, put the tile in a
// stage in shared memory and go on to the next tile, while the producer's other three warps store
// the stage to y. So the tensor cores, the copies in and the stores out all overlap.
// (One tile per block with the pipeline inside it is latency-bound; consumers that store their own
// tiles leave the tensor cores idle meanwhile.) The operands arrive as 128B-swizzled tiles:
//   - W [C_in, K] (B operand), as the ConvTranspose stores it: rows are channels, each 64 patch
//     columns of one 8 KB block (N-major).
//   - x tokens [B*N, C_in] (A): rows are tokens, K-major.
//   - x channels-first [B, C_in, N] (A): rows are channels, each warpgroup's 64 tokens one 128-byte
//     row (M-major; N % 64 == 0, so 64 tokens never straddle two samples).
// Channels past C_in, columns past K and tokens past the end read zeros; the latter two are never
// stored.
// Where kw = 2 and the tiles are whole grid rows (tma.cuh: encode_pair_box_map; 192 columns of whole
// channels), the stage is instead a pair box [pair][token] that one consumer thread stores to y by
// TMA, and the storer warps idle.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"
#include "kernels/primitives/tma.cuh"
#include "kernels/primitives/wgmma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kConsumers = 256;             // two warpgroups of 64 tokens
constexpr int kThreads = kConsumers + 128;  // and the producer's: thread 0 copies, warps 1-3 store
constexpr int kStorers = 96;
constexpr int kTileM = 128;                 // tokens per tile
constexpr int kTileN = 192;                 // patch columns per tile
constexpr int kTileK = 64;                  // input channels per slice
constexpr int kStages = 4;
constexpr int kSlotA = kTileM * 128, kSlot = kSlotA + kTileN * 128;  // bytes of a pipeline slot
// The output stage, [run][token] rows of kRun / 2 words: kRun = 2, pitch = 8 mod 32 words; 4, 16
// mod 32. kRun = 8: [token][run], a token's 24 runs of 4 words then 4 words of padding (100 = 4 mod
// 32). Conflict-free each way.
constexpr int kStagePitch = kTileM + 8;
constexpr int kTokenPitch = kTileN / 2 + 4;
constexpr int kStageBytes = kTileN / 2 * kStagePitch * 4;
static_assert(kTileM * kTokenPitch * 4 <= kStageBytes);
// Shared memory from a 1024-byte aligned base (the launch adds the slack): the slots, the stage, the
// mbarriers (landed and released per slot, then stage_full and stage_free), the storers' two tables
// of a tile's run offsets (at most kTileN / 2 runs each), and (kRun = 8) their two tables of its
// tokens' origins.
constexpr int kStageOffset = kStages * kSlot;
constexpr int kBarrierOffset = kStageOffset + kStageBytes;
constexpr int kTableOffset = kBarrierOffset + (2 * kStages + 2) * 8;
constexpr int kOriginOffset = kTableOffset + 2 * (kTileN / 2) * 4;
constexpr int kSmemBytes = 1024 + kOriginOffset + 2 * kTileM * 8;

// p describes y (the volume the patches tile) with p.E = C_in, the reduction. kRun = p.kw, or 8. Tile t
// covers tokens 128 (t / tiles_n) .. and columns 192 (t % tiles_n) ..: the blocks running at once
// share their x rows in L2.
// Where y's tiles are pair boxes (kBoxStore): where a tile goes, y's channels and a channel's columns.
struct BoxStore {
  PairTiles tiles_m;
  int channels, columns;
};

template <typename T, bool kTokensIn, int kRun, bool kBoxStore>
__global__ void __launch_bounds__(kThreads, 1)
    implicit_unembed_kernel_sm90(Problem p, PatchDivs divs, int tiles_n, int tiles,
                                 const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                                 const T* __restrict__ bias, T* __restrict__ y, BoxStore box,
                                 const __grid_constant__ CUtensorMap y_map) {
#ifdef PATCHGEMM_HAS_WGMMA
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  uint32_t* stage = reinterpret_cast<uint32_t*>(smem + kStageOffset);
  const SlotBarriers<kStages> landed{base + kBarrierOffset};
  const SlotBarriers<kStages> released{landed.base + kStages * 8};
  // The stage's handoff, per tile: every consumer arrives on stage_full when it has put its part,
  // every storer on stage_free when it has read its part (mbarriers: release and acquire, and
  // no whole-warp counting as named barriers do).
  const SlotBarriers<1> stage_full{released.base + kStages * 8}, stage_free{stage_full.base + 8};
  int* run_offset = reinterpret_cast<int*>(smem + kTableOffset);
  int64_t* token_origin = reinterpret_cast<int64_t*>(smem + kOriginOffset);  // kRun = 8; -1: past the end
  landed.init();
  released.init(2);  // one arrival per consumer warpgroup
  stage_full.init(kConsumers);
  stage_free.init(kStorers);
  if (threadIdx.x == 0) prefetch_tensor_map(x_map), prefetch_tensor_map(w_map);
  __syncthreads();
  const int k_tiles = (p.E + kTileK - 1) / kTileK;

  // 16-byte stores: kGroup tokens (one patch-grid row: gw % kGroup == 0) of one run.
  static_assert(kRun == 2 || kRun == 4 || kRun == 8);
  constexpr int kWordsPerRun = kRun / 2, kGroup = 8 / kRun, kGroups = kTileM / kGroup, kRuns = kTileN / kRun;
  // Registers move from the producer's warpgroup, which needs few, to the consumers' accumulators
  // and bias (launch bounds give each thread 168; 128 x 56 + 256 x 224 fit the SM's 64 K).
  if (threadIdx.x < kThreads - kConsumers) {
    set_max_registers<56, false>();
    if (threadIdx.x >= 32) {  // the storers
      if constexpr (kBoxStore) return;
      // Lane l of storer warp w stores the token groups l, l + 32, ... (one for kw = 2), runs w, w + 3, ...:
      // a warp's 16-byte stores are 32 consecutive groups of one run, and a thread's origins stay in
      // registers.
      constexpr int kGroupsPerLane = kGroups / 32, kStorerWarps = kStorers / 32;
      static_assert(kGroups % 32 == 0 && kStorers % 32 == 0);
      const int lane = threadIdx.x % 32, first_run = threadIdx.x / 32 - 1;
      // A tile's run offsets, in two tables: the next tile's is written while other storers may still
      // read this one's. Each storer writes its part before it arrives on stage_free, which the
      // consumers wait for before they fill the stage: so the table is whole when stage_full says go.
      auto write_table = [&](int tile, int* table) {
        const int col0 = tile % tiles_n * kTileN;
        for (int run = threadIdx.x - 32; run < kRuns; run += kStorers) {
          const int col = col0 + kRun * run;
          table[run] = col < p.K ? divs.offset(p, col) : -1;  // -1: past K (the last runs)
        }
      };
      int64_t origin[kGroupsPerLane];  // of this thread's token groups; -1: past the end
      auto find_origins = [&](int tile) {
        const int64_t m0 = static_cast<int64_t>(tile / tiles_n) * kTileM;
#pragma unroll
        for (int h = 0; h < kGroupsPerLane; ++h) {
          const int64_t token = m0 + kGroup * (lane + 32 * h);
          origin[h] = token < p.rows ? patch_origin(p, token) : -1;
        }
      };
      if constexpr (kRun == 8) {
        // The tile's 128 x 24 pieces, runs fastest: a warp stores 512 bytes of a token's row (or the
        // rows of kd * kh, if shorter), and a thread's pieces are kStorers apart.
        auto write_origins = [&](int tile, int64_t* table) {
          const int64_t m0 = static_cast<int64_t>(tile / tiles_n) * kTileM;
          for (int t = threadIdx.x - 32; t < kTileM; t += kStorers)
            table[t] = m0 + t < p.rows ? patch_origin(p, m0 + t) : -1;
        };
        write_table(blockIdx.x, run_offset);
        write_origins(blockIdx.x, token_origin);
        stage_free.arrive(0);
        for (int tile = blockIdx.x, n = 0; tile < tiles; tile += gridDim.x, ++n) {
          const int* table = run_offset + n % 2 * kRuns;
          const int64_t* origins = token_origin + n % 2 * kTileM;
          stage_full.wait(n);
#pragma unroll 4
          for (int piece = threadIdx.x - 32; piece < kTileM * kRuns; piece += kStorers) {
            const int token = piece / kRuns, run = piece - token * kRuns;
            const int offset = table[run];
            const int64_t origin = origins[token];
            if (offset >= 0 && origin >= 0) {
              *reinterpret_cast<uint4*>(y + origin + offset) =
                  *reinterpret_cast<const uint4*>(stage + token * kTokenPitch + run * kWordsPerRun);
            }
          }
          const int next = tile + static_cast<int>(gridDim.x);
          if (next < tiles) {
            write_table(next, run_offset + (n + 1) % 2 * kRuns);
            write_origins(next, token_origin + (n + 1) % 2 * kTileM);
          }
          stage_free.arrive(0);
        }
        return;
      }
      write_table(blockIdx.x, run_offset);
      stage_free.arrive(0);  // phase 0: the first table is written; phase n + 1: tile n is stored
      find_origins(blockIdx.x);
      for (int tile = blockIdx.x, n = 0; tile < tiles; tile += gridDim.x, ++n) {
        const int* table = run_offset + n % 2 * kRuns;
        stage_full.wait(n);
#pragma unroll
        for (int h = 0; h < kGroupsPerLane; ++h) {
          const uint32_t* from = stage + kGroup * (lane + 32 * h) * kWordsPerRun;
#pragma unroll 4
          for (int run = first_run; run < kRuns; run += kStorerWarps) {
            const int offset = table[run];
            if (offset < 0) break;  // (the same for the whole warp)
            if (origin[h] >= 0) {
              *reinterpret_cast<uint4*>(y + origin[h] + offset) =
                  *reinterpret_cast<const uint4*>(from + run * kStagePitch * kWordsPerRun);
            }
          }
        }
        const int next = tile + static_cast<int>(gridDim.x);
        if (next < tiles) write_table(next, run_offset + (n + 1) % 2 * kRuns);
        stage_free.arrive(0);
        if (next < tiles) find_origins(next);
      }
      return;
    }
    if (threadIdx.x != 0) return;
    int it = 0;  // slices copied, over all of this block's tiles
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int64_t m0 = static_cast<int64_t>(tile / tiles_n) * kTileM;
      const int col0 = tile % tiles_n * kTileN;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        released.wait_released(it);
        const int slot = it % kStages, c0 = kt * kTileK;
        const uint32_t slot_base = base + slot * kSlot, bar = landed.arm(slot, kSlot);
        if constexpr (kTokensIn) {
          tma_load(slot_base, x_map, bar, c0, static_cast<int>(m0));
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // a tile past the end re-reads the last 64 tokens (never stored)
            const int64_t token = min(m0 + 64 * h, p.rows - 64), b = token / p.tokens;
            tma_load(slot_base + h * 8192, x_map, bar, static_cast<int>(token - b * p.tokens), c0,
                     static_cast<int>(b));
          }
        }
#pragma unroll
        for (int h = 0; h < kTileN / 64; ++h) tma_load(slot_base + kSlotA + h * 8192, w_map, bar, col0 + 64 * h, c0);
      }
    }
    return;
  }

  set_max_registers<224, true>();
  const int thread = threadIdx.x - (kThreads - kConsumers);  // among the consumers
  const int wg = thread / 128, wq = thread / 32 % 4, lane = thread % 32, g = lane / 4, q = lane % 4;
  int it = 0;  // slices consumed
  for (int tile = blockIdx.x, n = 0; tile < tiles; tile += gridDim.x, ++n) {
    const int col0 = tile % tiles_n * kTileN;
    // acc[4 j + 2 half + i]: token wg*64 + wq*16 + g + 8 half, column 8 j + 2 q + i. The bias is per
    // output channel (PatchDivs::channel), a pair of 16-bit values per column pair; fetched now, used
    // after the GEMM.
    uint32_t bias_of[kTileN / 8];
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
      const int column = min(col0 + 8 * j + 2 * q, p.K - 2);
      bias_of[j] = bias ? pack2<T>(to_float(bias[divs.channel(p, column)]), to_float(bias[divs.channel(p, column + 1)]))
                        : 0u;
    }
    float acc[kTileN / 2];
#pragma unroll
    for (int i = 0; i < kTileN / 2; ++i) acc[i] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const uint32_t slot_base = base + it % kStages * kSlot;
      landed.wait(it);
      fence_accumulators(acc);
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kTileK / 16; ++t) {
        // A: K-major steps 32 bytes along a row; M-major ones 2048 bytes (16 rows of channels).
        const uint32_t a = slot_base + (kTokensIn ? wg * 64 * 128 + 32 * t : wg * 8192 + 2048 * t);
        const uint64_t b = smem_descriptor_128b(slot_base + kSlotA + 2048 * t, 8192);
        wgmma_ss<T, kTileN, !kTokensIn, true>(acc, smem_descriptor_128b(a), b);
      }
      wgmma_commit();
      fence_accumulators(acc);
      wgmma_wait<1>();  // the previous slice's group is done: its slot goes back to the producer
      fence_accumulators(acc);
      if (kt > 0 && thread % 128 == 0) released.arrive((it - 1) % kStages);
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (thread % 128 == 0) released.arrive((it - 1) % kStages);

    if constexpr (kBoxStore) {
      // [pair 4 j + q][token], a word per pair; one thread stores the box once all have put theirs
      // (and the previous tile's box has been read).
      if (thread == 0) tma_store_wait_read();
      named_barrier_sync(1, kConsumers);
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int token = wg * 64 + wq * 16 + g + half * 8;
          float lo, hi;
          unpack2<T>(bias_of[j], lo, hi);
          st_shared(base + kStageOffset + pair_box_offset(4 * j + q, token, box.tiles_m.gw),
                    pack2<T>(acc[4 * j + 2 * half] + lo, acc[4 * j + 2 * half + 1] + hi));
        }
      }
      fence_proxy_async();  // the stage's writes, visible to the TMA store
      named_barrier_sync(1, kConsumers);
      if (thread == 0) {
        const PairTiles::Origin o = box.tiles_m.origin(tile / tiles_n);
        tma_store(y_map, base + kStageOffset, 0, o.y0, 0, o.z * p.kd, o.b * box.channels + col0 / box.columns);
        tma_store_commit();
      }
      continue;
    }
    stage_free.wait(n);  // the storers have read the previous tile (and written this one's table)
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
      const int column = 8 * j + 2 * q, run = column / kRun;
      float lo, hi;
      unpack2<T>(bias_of[j], lo, hi);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int token = wg * 64 + wq * 16 + g + half * 8;
        const int word = kRun == 8 ? token * kTokenPitch + run * kWordsPerRun + q
                                   : (run * kStagePitch + token) * kWordsPerRun + column % kRun / 2;
        stage[word] = pack2<T>(acc[4 * j + 2 * half] + lo, acc[4 * j + 2 * half + 1] + hi);
      }
    }
    stage_full.arrive(0);
  }
  if (kBoxStore && thread == 0) tma_store_wait();
#endif
}

// The tensor maps of x (tokens [rows, C_in] or channels-first [B, C_in, N]) and w [C_in, K], both
// contiguous; false where TMA cannot read them (16-byte rows) or a coordinate would overflow.
bool encode_maps(const Problem& p, bool tokens, const at::Tensor& x, const at::Tensor& w, CUtensorMap& x_map,
                 CUtensorMap& w_map) {
  const uint64_t C_in = p.E, K = p.K, N = p.tokens, rows = p.rows;
  if (rows >= (uint64_t{1} << 31) || K % 8 || (tokens ? C_in % 8 : N % 64)) return false;
  const uint64_t w_dims[2] = {K, C_in}, w_strides[1] = {K * 2};
  const uint32_t w_box[2] = {64, kTileK};
  if (!encode_tensor_map(w_map, w.const_data_ptr(), 2, w_dims, w_strides, w_box)) return false;
  if (tokens) {
    const uint64_t dims[2] = {C_in, rows}, strides[1] = {C_in * 2};
    const uint32_t box[2] = {kTileK, kTileM};
    return encode_tensor_map(x_map, x.const_data_ptr(), 2, dims, strides, box);
  }
  const uint64_t dims[3] = {N, C_in, rows / N}, strides[2] = {N * 2, C_in * N * 2};
  const uint32_t box[3] = {64, kTileK, 1};
  return encode_tensor_map(x_map, x.const_data_ptr(), 3, dims, strides, box);
}

template <typename T, bool kTokensIn, int kRun, bool kBoxStore>
bool launch(const Problem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
            const at::Tensor& y5, const BoxStore& box, const CUtensorMap& y_map) {
  static_assert(kTileN / kRun * kStagePitch * kRun * 2 <= kStageBytes && kTileM * kTileN * 2 <= kStageBytes);
  const cudaDeviceProp& device = *at::cuda::getCurrentDeviceProperties();
  const int64_t tiles_n = (p.K + kTileN - 1) / kTileN, tiles = (p.rows + kTileM - 1) / kTileM * tiles_n;
  if (kSmemBytes > static_cast<int>(device.sharedMemPerBlockOptin) || tiles > INT_MAX) return false;
  CUtensorMap x_map, w_map;
  if (!encode_maps(p, kTokensIn, x, w, x_map, w_map)) return false;
  auto kernel = implicit_unembed_kernel_sm90<T, kTokensIn, kRun, kBoxStore>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmemBytes);
  const int64_t blocks = std::min<int64_t>(tiles, device.multiProcessorCount);
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(
      p, PatchDivs(p), static_cast<int>(tiles_n), static_cast<int>(tiles), x_map, w_map,
      bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr, static_cast<T*>(y5.data_ptr()), box, y_map);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// y's tiles as pair boxes: kw = 2, whole grid rows per tile, 192 columns of whole channels, y
// contiguous; the map of y5 in `y_map`.
bool box_store_fits(const Problem& p, const at::Tensor& y5, BoxStore& box, CUtensorMap& y_map) {
  box.columns = 2 * p.kd * p.kh;
  if (!pair_tiles_fit(p) || p.K % kTileN || kTileN % box.columns || !y5.is_contiguous() ||
      reinterpret_cast<uintptr_t>(y5.data_ptr()) % 16 || y5.size(0) * y5.size(1) >= INT_MAX) {
    return false;
  }
  box.tiles_m = pair_tiles(p);
  box.channels = static_cast<int>(y5.size(1));
  return encode_pair_box_map(y_map, y5.data_ptr(), y5.size(0) * y5.size(1), y5.size(2), y5.size(3), y5.size(4), p.kd,
                             p.kh, kTileN / box.columns);
}

template <typename T>
bool launch_for_layout(bool tokens, const Problem& p, const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, const at::Tensor& y5) {
  BoxStore box{};
  CUtensorMap y_map{};
  if (p.kw % 8 == 0) {
    return tokens ? launch<T, true, 8, false>(p, x, w, bias, y5, box, y_map)
                  : launch<T, false, 8, false>(p, x, w, bias, y5, box, y_map);
  }
  if (p.kw == 4) {
    return tokens ? launch<T, true, 4, false>(p, x, w, bias, y5, box, y_map)
                  : launch<T, false, 4, false>(p, x, w, bias, y5, box, y_map);
  }
  if (box_store_fits(p, y5, box, y_map)) {
    return tokens ? launch<T, true, 2, true>(p, x, w, bias, y5, box, y_map)
                  : launch<T, false, 2, true>(p, x, w, bias, y5, box, y_map);
  }
  return tokens ? launch<T, true, 2, false>(p, x, w, bias, y5, box, y_map)
                : launch<T, false, 2, false>(p, x, w, bias, y5, box, y_map);
}

}  // namespace

bool implicit_unembed_sm90(const Problem& p, bool tokens, const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& bias, const at::Tensor& y5, std::string& why) {
#ifdef PATCHGEMM_SM90A
  const bool launched = y5.scalar_type() == at::kHalf ? launch_for_layout<__half>(tokens, p, x, w, bias, y5)
                                                      : launch_for_layout<__nv_bfloat16>(tokens, p, x, w, bias, y5);
  return launched || decline(why, tokens ? "needs K % 8 == 0 (TMA rows), 2^31 rows at most"
                                         : "needs K % 8 == 0 and N % 64 == 0 (TMA rows), 2^31 rows at most");
#else
  return decline(why, "not built for sm_90a");
#endif
}

}  // namespace cuda
}  // namespace patchgemm
