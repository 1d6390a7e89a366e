// The small-group GEMMs of small_group_gemm.h, on mma.sync (m16n8k16 for 16-bit data, m16n8k8
// TF32 for fp32; fp32 accumulation).
//
// Apply (forward and input gradient): out[b, g] = matrix[g] [M, K] @ x[b, g] [K, L]. The work is
// cut into tiles of one (group, sample) and 128 positions (64 for short samples and fp32), numbered
// group-major. Persistent blocks form teams of `team` (1 or 2); a team takes a contiguous range of
// the tiles, and its members the position tiles j, j + team, ... of each (group, sample), so
// neighbours read and write neighbouring positions at about the same time: the DRAM sees runs of
// 512 bytes instead of 256. A block meets a new group once or twice. Its warps are kWarpsM (rows) x
// 2 (positions): 4 x 2 warps, each owning 32 output rows, or, for 16-bit groups of more than 16 rows
// at 128 positions, 8 x 2 warps of 16 rows each. A warp keeps its rows of the group's matrix in
// registers (at most 2 x 8 fragments, 2 x 16 for fp32, read from global memory when the group
// changes). The kernel is latency-bound at one block per SM, so the 16-warp layout (half the
// fragments and accumulators per warp: under 128 registers, no spills) moves more bytes; with at
// most 16 rows only one row of warps has work either way and the extra warps cost. x tiles
// [K][positions] stream through a cp.async pipeline (3 or 4 slots), so the next tiles are in flight
// while one is multiplied; the rows K..16k of every slot stay zero. The accumulators start at the
// bias; the output tile is staged in shared memory (two stages: tile t - 1 leaves while tile t is
// multiplied, one barrier per tile) and leaves in whole 16-byte vectors.
//
// Weight gradient: grad_w[g] [M, K] = sum over (b, l) of grad_y[b, g] [M, L] @ x[b, g]^T [L, K], a
// GEMM whose reduction runs over all positions of all samples. Each block owns one group and a
// range of 64-position slices (grid: splits x G, enough blocks to fill every SM) and accumulates the
// whole [<= 128 x 128] product in registers through the implicit GEMMs' pipelined main loop. One
// range writes grad_w itself; several write fp32 partial sums, and the group's last block to finish
// (a counter per group) adds them up in range order and writes grad_w: no further launch, and the
// same sums in the same order on every run (deterministic, unlike atomic adds). The bias gradient
// rides along as one more column of x, all ones.
#include "kernels/gemm/small_group_gemm.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRows = 128;  // M and K: 4 warps x 32 rows; 8 k-steps of 16

template <typename T>
struct ApplyArgs {
  const T* x;
  int64_t x_b, x_g, x_k;  // strides; positions contiguous
  const T* matrix;
  int64_t m_g, m_m, m_k;
  const T* bias;  // nullptr: none
  int64_t bias_g, bias_m;
  T* out;
  int64_t out_b, out_g, out_m;
  int groups, batch, rows, depth, length;  // G, B, M, K, L
  int l_tiles;                             // tiles per (group, sample): set by the tiling's launch
  int team;                                // blocks per team; divides l_tiles
  int64_t tiles;                           // tiles per team member: G * B * l_tiles / team
};

// A tile's coordinates, stepped through a block's range (no 64-bit division per tile): the position
// tiles first, first, + step, ... of a (group, sample), then the next sample.
struct TileCursor {
  int g, b, lt;  // group, sample, position tile
  __device__ __forceinline__ void advance(int batch, int l_tiles, int step, int first) {
    if ((lt += step) >= l_tiles) {
      lt = first;
      if (++b == batch) b = 0, ++g;
    }
  }
};

// matrix[g][r][k] as a 16-bit pair (k, k + 1) of an mma A fragment; zero past M and K.
template <typename T>
__device__ __forceinline__ uint32_t matrix_pair(const T* m, int64_t m_m, int64_t m_k, int rows, int depth, int r,
                                                int k) {
  const T lo = r < rows && k < depth ? m[r * m_m + k * m_k] : zero<T>();
  const T hi = r < rows && k + 1 < depth ? m[r * m_m + (k + 1) * m_k] : zero<T>();
  return pack2<T>(to_float(lo), to_float(hi));
}

// matrix[g][r][k] rounded to TF32, an element of a tf32 mma A fragment; zero past M and K.
__device__ __forceinline__ uint32_t matrix_tf32(const float* m, int64_t m_m, int64_t m_k, int rows, int depth, int r,
                                                int k) {
  return to_tf32(r < rows && k < depth ? m[r * m_m + k * m_k] : 0.f);
}

// kTileL positions per tile (2 warps x kTileL / 2), kStages slots in the x pipeline, kKSteps steps
// of 16 over K. 16-bit: m16n8k16, the B fragments by ldmatrix.trans. fp32 (TF32 math, the inputs
// rounded to nearest as cuBLAS does): two m16n8k8 per step, B fragments read element by element.
template <typename T, int kKSteps, int kTileL, int kStages, int kMinBlocks, int kWarpsM>
__global__ void __launch_bounds__(64 * kWarpsM, kMinBlocks) small_group_apply_kernel(const ApplyArgs<T> a) {
#if __CUDA_ARCH__ >= 800
  constexpr bool kTf32 = std::is_same_v<T, float>;
  constexpr int kWarpsN = 2, kBlockThreads = 32 * kWarpsM * kWarpsN;
  constexpr int kMTiles = kMaxRows / 16 / kWarpsM;  // m16 tiles per warp
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int kK = kKSteps * 16, kChunks = kTileL / kVec;
  constexpr int kPairs = kTileL / kWarpsN / 16;  // n8-tile pairs per warp
  // Elements per shared row. 16-bit: an odd multiple of 16 bytes, conflict-free ldmatrix; fp32: 8
  // words past a multiple of 32, so the lanes' (k = lane % 4, n = lane / 4) reads hit 32 banks.
  constexpr int kLPitch = kTileL + 8;
  constexpr int kSlot = kK * kLPitch;
  constexpr int kRowsPerPass = kBlockThreads / kChunks;  // rows a block's 16-byte copies cover at once
  extern __shared__ __align__(128) unsigned char smem[];
  T* const stages = reinterpret_cast<T*>(smem);  // 2 x [kMaxRows][kLPitch]: output tiles t and t - 1
  T* const xs = stages + 2 * kMaxRows * kLPitch;  // kStages slots of [kK][kLPitch]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int warp_m = warp % kWarpsM, warp_n = warp / kWarpsM;
  const int teams = gridDim.x / a.team, team = blockIdx.x / a.team, member = blockIdx.x % a.team;
  const int64_t begin = team * a.tiles / teams, end = (team + 1) * a.tiles / teams;

  // Zero rows depth..kK of every slot: the matrix's padding columns are zero, but 0 * garbage may be NaN.
  for (int i = tid; i < kStages * (kK - a.depth) * kChunks; i += kBlockThreads) {
    const int slot = i / ((kK - a.depth) * kChunks), row = a.depth + i / kChunks % (kK - a.depth);
    *reinterpret_cast<uint4*>(xs + slot * kSlot + row * kLPitch + i % kChunks * kVec) = make_uint4(0, 0, 0, 0);
  }

  // A thread copies (and stores) the 16-byte chunk `chunk` of rows first_row, + kRowsPerPass, ...
  const int chunk = tid % kChunks, first_row = tid / kChunks;
  const uint32_t copy_dst = smem_address(xs + first_row * kLPitch + chunk * kVec);
  TileCursor next{0, 0, 0};
  const int per_sample = a.l_tiles / a.team;  // a member's position tiles per (group, sample)
  {
    const int64_t per_group = int64_t{a.batch} * per_sample;
    next.g = static_cast<int>(begin / per_group);
    next.b = static_cast<int>(begin % per_group / per_sample);
    next.lt = static_cast<int>(begin % per_sample) * a.team + member;
  }
  TileCursor cur = next;
  // Issues the copies of the tile at `next` into `slot`, and steps `next` on.
  auto load_next = [&](int slot) {
    const int l = next.lt * kTileL + chunk * kVec;
    const bool valid = l < a.length;
    const T* src = a.x + next.b * a.x_b + next.g * a.x_g + first_row * a.x_k + (valid ? l : 0);
    uint32_t dst = copy_dst + slot * kSlot * sizeof(T);
    for (int row = first_row; row < a.depth; row += kRowsPerPass) {
      cp_async<16>(dst, src, valid);
      src += kRowsPerPass * a.x_k;
      dst += kRowsPerPass * kLPitch * sizeof(T);
    }
    next.advance(a.batch, a.l_tiles, a.team, member);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (begin + s < end) load_next(s);
    cp_async_commit();
  }
  // This warp's rows: m-tile mt covers r0 + mt * 16 ..; a lane's are r0 + mt * 16 + lane / 4 (+ 8).
  const int r0 = warp_m * kMTiles * 16, n0 = warp_n * (kTileL / kWarpsN);
  bool live[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) live[mt] = r0 + mt * 16 < a.rows;
  uint32_t af[kMTiles][kTf32 ? 2 * kKSteps : kKSteps][4];  // per mma k-step
  float bias_v[kMTiles][2] = {};
  int group = -1;
  // Writes the staged output tile at `at` to out, in 16-byte vectors.
  auto store_tile = [&](const TileCursor& at, const T* stage) {
    const int l = at.lt * kTileL + chunk * kVec;
    if (l >= a.length) return;
    T* dst = a.out + at.b * a.out_b + at.g * a.out_g + first_row * a.out_m + l;
    const T* src = stage + first_row * kLPitch + chunk * kVec;
    for (int row = first_row; row < a.rows; row += kRowsPerPass) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      dst += kRowsPerPass * a.out_m;
      src += kRowsPerPass * kLPitch;
    }
  };
  TileCursor prev = cur;
  for (int64_t t = begin, i = 0; t < end; ++t, ++i) {
    cp_async_wait<kStages - 2>();
    // Tile t has landed; every warp has staged tile t - 1 and stored tile t - 2, so the slot of
    // tile t - 1 and the stage of tile t - 2 are free again.
    __syncthreads();
    if (t + kStages - 1 < end) load_next((i + kStages - 1) % kStages);
    cp_async_commit();
    if (i > 0) store_tile(prev, stages + (i - 1) % 2 * kMaxRows * kLPitch);
    T* const stage = stages + i % 2 * kMaxRows * kLPitch;
    if (cur.g != group) {  // the block's first tile of a group: the warp's rows of its matrix into registers
      group = cur.g;
      const T* m = a.matrix + group * a.m_g;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const int row = r0 + mt * 16 + lane / 4;
        if constexpr (kTf32) {
#pragma unroll
          for (int ks = 0; ks < 2 * kKSteps; ++ks) {
            const int k = ks * 8 + lane % 4;
            af[mt][ks][0] = matrix_tf32(m, a.m_m, a.m_k, a.rows, a.depth, row, k);
            af[mt][ks][1] = matrix_tf32(m, a.m_m, a.m_k, a.rows, a.depth, row + 8, k);
            af[mt][ks][2] = matrix_tf32(m, a.m_m, a.m_k, a.rows, a.depth, row, k + 4);
            af[mt][ks][3] = matrix_tf32(m, a.m_m, a.m_k, a.rows, a.depth, row + 8, k + 4);
          }
        } else {
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) {
            const int k = ks * 16 + 2 * (lane % 4);
            af[mt][ks][0] = matrix_pair(m, a.m_m, a.m_k, a.rows, a.depth, row, k);
            af[mt][ks][1] = matrix_pair(m, a.m_m, a.m_k, a.rows, a.depth, row + 8, k);
            af[mt][ks][2] = matrix_pair(m, a.m_m, a.m_k, a.rows, a.depth, row, k + 8);
            af[mt][ks][3] = matrix_pair(m, a.m_m, a.m_k, a.rows, a.depth, row + 8, k + 8);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row + h * 8;
          bias_v[mt][h] = a.bias && r < a.rows ? to_float(a.bias[group * a.bias_g + r * a.bias_m]) : 0.f;
        }
      }
    }
    if (live[0]) {
      const T* xslot = xs + i % kStages * kSlot;
      // acc[mt][j]: rows lane / 4 (c0, c1) and + 8 (c2, c3), positions 2 (lane % 4) and + 1 of n-tile j;
      // it starts at the bias.
      float acc[kMTiles][kPairs * 2][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int j = 0; j < kPairs * 2; ++j) {
          acc[mt][j][0] = acc[mt][j][1] = bias_v[mt][0];
          acc[mt][j][2] = acc[mt][j][3] = bias_v[mt][1];
        }
      }
      if constexpr (kTf32) {
        // B (k = lane % 4 and + 4, n = lane / 4 of each n-tile) straight from the slot, rounded.
#pragma unroll
        for (int ks = 0; ks < 2 * kKSteps; ++ks) {
          const T* xk = xslot + (ks * 8 + lane % 4) * kLPitch + n0 + lane / 4;
#pragma unroll
          for (int j = 0; j < kPairs * 2; ++j) {
            const uint32_t b[2] = {to_tf32(xk[j * 8]), to_tf32(xk[4 * kLPitch + j * 8])};
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              if (mt == 0 || live[mt]) mma_1688_tf32(acc[mt][j], af[mt][ks], b);
            }
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
          for (int np = 0; np < kPairs; ++np) {
            uint32_t r[4];
            ldmatrix_x4_trans(r, smem_address(xslot + (ks * 16 + lane % 16) * kLPitch + n0 + np * 16 + lane / 16 * 8));
            const uint32_t b_lo[2] = {r[0], r[1]}, b_hi[2] = {r[2], r[3]};
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              if (mt == 0 || live[mt]) {
                mma_16816<T>(acc[mt][2 * np], af[mt][ks], b_lo);
                mma_16816<T>(acc[mt][2 * np + 1], af[mt][ks], b_hi);
              }
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if (!live[mt]) continue;
        const int row = r0 + mt * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < kPairs * 2; ++j) {
          const int col = n0 + j * 8 + 2 * (lane % 4);
          if constexpr (kTf32) {
            *reinterpret_cast<float2*>(stage + row * kLPitch + col) = make_float2(acc[mt][j][0], acc[mt][j][1]);
            *reinterpret_cast<float2*>(stage + (row + 8) * kLPitch + col) = make_float2(acc[mt][j][2], acc[mt][j][3]);
          } else {
            *reinterpret_cast<uint32_t*>(stage + row * kLPitch + col) = pack2<T>(acc[mt][j][0], acc[mt][j][1]);
            *reinterpret_cast<uint32_t*>(stage + (row + 8) * kLPitch + col) = pack2<T>(acc[mt][j][2], acc[mt][j][3]);
          }
        }
      }
    }
    prev = cur;
    cur.advance(a.batch, a.l_tiles, a.team, member);
  }
  if (end > begin) {
    __syncthreads();
    store_tile(prev, stages + (end - begin - 1) % 2 * kMaxRows * kLPitch);
  }
  cp_async_wait<0>();
#endif
}

constexpr int kGradTileL = 64;  // positions per weight-gradient slice
constexpr int kGradStages = 3;
constexpr int kGradPitch = kGradTileL + 8;  // 144 bytes: conflict-free ldmatrix
constexpr int kGradSlot = kMaxRows * kGradPitch;

template <typename T>
struct GradArgs {
  const T* dy;
  int64_t dy_b, dy_g, dy_m;  // strides; positions contiguous
  const T* x;
  int64_t x_b, x_g, x_k;
  float* partial = nullptr;  // [splits, G, M x columns rounded up to 4] (several ranges only)
  int* arrivals = nullptr;   // [G], zero: the group's blocks that have written their partial sums
  T* grad_w;                 // [G, M, K], contiguous
  T* grad_b;                 // [G, M], contiguous; nullptr: no bias gradient
  int groups, rows, depth, length;  // G, M, K, L
  int columns;                      // K, or K + 1 with the bias gradient (its sums of grad_y's rows)
  int l_tiles;                      // slices per sample
  int slices;                       // B * l_tiles, per group
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) small_group_weight_grad_kernel(const GradArgs<T> a) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem[];
  T* sa = reinterpret_cast<T*>(smem);       // kGradStages slots of grad_y [kMaxRows][kGradPitch]
  T* sb = sa + kGradStages * kGradSlot;     // and of x, the same
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int warp_m = warp % 4, warp_n = warp / 4;
  const int64_t g = blockIdx.y, split = blockIdx.x;
  const int begin = static_cast<int>(split * a.slices / gridDim.x),
            end = static_cast<int>((split + 1) * a.slices / gridDim.x);
  constexpr int kChunksG = kGradTileL / 8;

  // Rows past M and K are never loaded; zero keeps the products they feed (discarded) defined. With
  // the bias gradient, x's row K is all ones: column K of the product sums grad_y's rows (exactly,
  // in fp32; the positions past L are zero in grad_y).
  const uint32_t ones = pack2<T>(1.f, 1.f);
  for (int i = tid; i < kGradStages * kMaxRows * kChunksG; i += kThreads) {
    const int slot = i / (kMaxRows * kChunksG), row = i / kChunksG % kMaxRows, chunk = i % kChunksG;
    const uint4 zeros = make_uint4(0, 0, 0, 0);
    if (row >= a.rows) *reinterpret_cast<uint4*>(sa + slot * kGradSlot + row * kGradPitch + chunk * 8) = zeros;
    if (row >= a.depth) {
      *reinterpret_cast<uint4*>(sb + slot * kGradSlot + row * kGradPitch + chunk * 8) =
          row < a.columns ? make_uint4(ones, ones, ones, ones) : zeros;
    }
  }
  __syncthreads();

  auto load_slice = [&](int kt, int slot) {
    const int q = begin + kt, b = q / a.l_tiles;
    const int l0 = (q - b * a.l_tiles) * kGradTileL;
    const T* dy = a.dy + b * a.dy_b + g * a.dy_g + l0;
    const T* x = a.x + b * a.x_b + g * a.x_g + l0;
    const uint32_t dst_a = smem_address(sa + slot * kGradSlot), dst_b = smem_address(sb + slot * kGradSlot);
    for (int idx = tid; idx < (a.rows + a.depth) * kChunksG; idx += kThreads) {
      const int row = idx / kChunksG, chunk = idx % kChunksG;
      const bool valid = l0 + chunk * 8 < a.length;
      const int offset = valid ? chunk * 8 : 0;
      if (row < a.rows) {
        cp_async<16>(dst_a + (row * kGradPitch + chunk * 8) * 2, dy + row * a.dy_m + offset, valid);
      } else {
        const int k = row - a.rows;
        cp_async<16>(dst_b + (k * kGradPitch + chunk * 8) * 2, x + k * a.x_k + offset, valid);
      }
    }
  };

  // A = grad_y [m][l] (ldmatrix), B = x as [k][l], the column-major B operand (ldmatrix, no transpose).
  const int r0 = warp_m * 32, c0 = warp_n * 64;
  const bool live = r0 < a.rows && c0 < a.columns;
  const uint32_t a_frag = smem_address(sa + (r0 + lane % 16) * kGradPitch + lane / 16 * 8);
  const uint32_t b_frag = smem_address(sb + (c0 + lane / 16 * 8 + lane % 8) * kGradPitch + lane / 8 % 2 * 8);
  uint32_t af[2][2][4], bf[2][8][2];
  auto load_fragments = [&](int buf, int slot, int kk) {
    if (!live) return;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      ldmatrix_x4(af[buf][mt], a_frag + (slot * kGradSlot + mt * 16 * kGradPitch + kk) * 2);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t r[4];
      ldmatrix_x4(r, b_frag + (slot * kGradSlot + np * 16 * kGradPitch + kk) * 2);
      bf[buf][2 * np][0] = r[0], bf[buf][2 * np][1] = r[1], bf[buf][2 * np + 1][0] = r[2],
                  bf[buf][2 * np + 1][1] = r[3];
    }
  };
  float acc[2][8][4] = {};
  pipelined_main_loop<kGradStages, kGradTileL>(end - begin, load_slice, load_fragments, [&](int buf) {
    if (!live) return;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int j = 0; j < 8; ++j) mma_16816<T>(acc[mt][j], af[buf][mt], bf[buf][j]);
    }
  });

  // acc[mt][j]: rows lane / 4 (c0, c1) and + 8 (c2, c3), columns 2 (lane % 4) and + 1 of n-tile j.
  const int64_t cells = (int64_t{a.rows} * a.columns + 3) / 4 * 4;  // a slab of partials, in whole quads
  const bool alone = gridDim.x == 1;
  float* out = a.partial + (split * a.groups + g) * cells;
  auto write_grad = [&](int row, int col, float v) {  // column K: the bias gradient
    if (col < a.depth) {
      a.grad_w[(g * a.rows + row) * a.depth + col] = from_float<T>(v);
    } else {
      a.grad_b[g * a.rows + row] = from_float<T>(v);
    }
  };
  auto put = [&](int row, int col, float v) {
    if (alone) {
      write_grad(row, col, v);
    } else {
      out[row * a.columns + col] = v;
    }
  };
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + mt * 16 + h * 8 + lane / 4;
      if (row >= a.rows) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = c0 + j * 8 + 2 * (lane % 4);
        if (col < a.columns) put(row, col, acc[mt][j][2 * h]);
        if (col + 1 < a.columns) put(row, col + 1, acc[mt][j][2 * h + 1]);
      }
    }
  }
  if (alone) return;
  // The last of the group's blocks to arrive sums the ranges' partials: the fence makes this block's
  // partials visible before its arrival counts, and the last block's reads bypass L1.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(a.arrivals + g, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // (Four quads per thread per round, every range's loads in flight together: the sum is on the
  // kernel's tail.)
  const int64_t quads = cells / 4, split_quads = a.groups * quads;
  const float4* first = reinterpret_cast<const float4*>(a.partial) + g * quads;
  for (int64_t q0 = tid; q0 < quads; q0 += 4 * kThreads) {
    float4 sum[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t q = q0 + u * kThreads;
      sum[u] = q < quads ? __ldcg(first + q) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int s = 1; s < static_cast<int>(gridDim.x); ++s) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t q = q0 + u * kThreads;
        if (q >= quads) continue;
        const float4 v = __ldcg(first + s * split_quads + q);
        sum[u].x += v.x, sum[u].y += v.y, sum[u].z += v.z, sum[u].w += v.w;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t q = q0 + u * kThreads;
      if (q >= quads) continue;
      const float v[4] = {sum[u].x, sum[u].y, sum[u].z, sum[u].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 4 * q + e;
        if (i >= int64_t{a.rows} * a.columns) break;
        write_grad(static_cast<int>(i / a.columns), static_cast<int>(i % a.columns), v[e]);
      }
    }
  }
#endif
}

bool decline(std::string& why, const char* reason) {
  why = reason;
  return false;
}

// Where the kernels apply: sm_80+, and the positions of every operand in 16-byte runs.
bool positions_aligned(const at::Tensor& t) {
  const int64_t vec = 16 / t.element_size();
  if (t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % vec) return false;
  }
  return true;
}

bool common_checks(const at::Tensor& x, int64_t rows, int64_t depth, bool fp32, std::string& why,
                   std::initializer_list<at::Tensor> operands) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16 && !(fp32 && dtype == at::kFloat)) {
    return decline(why, fp32 ? "float32, float16 and bfloat16 only" : "16-bit dtypes only");
  }
  if (rows > kMaxRows || depth > kMaxRows) return decline(why, "groups of at most 128 channels in and out only");
  if (x.numel() == 0 || rows == 0) return decline(why, "empty problem");
  if (x.size(3) % 8) return decline(why, "positions per sample must be a multiple of 8");
  if (x.size(0) >= INT_MAX || x.size(1) >= INT_MAX || x.size(3) >= INT_MAX)
    return decline(why, "sizes past 32-bit indices");
  for (const at::Tensor& t : operands) {
    if (!positions_aligned(t)) return decline(why, "positions must be contiguous, in 16-byte aligned runs of 8");
  }
  if (at::cuda::getDeviceProperties(x.get_device())->major < 8) return decline(why, "needs sm_80 or newer");
  return true;
}

template <typename T, int kKSteps, int kTileL, int kStages>
constexpr int apply_smem = (2 * kMaxRows + kStages * kKSteps * 16) * (kTileL + 8) * sizeof(T);

// Whether a block with `smem` bytes of dynamic shared memory fits on the current GPU.
bool smem_fits(int smem) {
  return smem <= static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
}

template <typename T, int kKSteps, int kTileL, int kStages, int kMinBlocks, int kWarpsM = 4>
bool launch_apply(ApplyArgs<T> args) {
  constexpr int smem = apply_smem<T, kKSteps, kTileL, kStages>;
  constexpr int threads = 64 * kWarpsM;  // kWarpsM x 2 warps
  if (!smem_fits(smem)) return false;
  const auto kernel = small_group_apply_kernel<T, kKSteps, kTileL, kStages, kMinBlocks, kWarpsM>;
  const LaunchShape shape = prepare_launch(reinterpret_cast<const void*>(kernel), threads, smem);
  TORCH_CHECK(shape.blocks_per_sm > 0, "small_group_apply: ", smem, " bytes of shared memory fit no block on this GPU");
  args.l_tiles = (args.length + kTileL - 1) / kTileL;
  // Pairs where the position tiles pair up and a sample's row is longer than the pipeline's reach
  // (at two tiles a block reads whole rows by itself). Wider teams measured slower on H100.
  args.team = args.l_tiles % 2 == 0 && args.l_tiles >= 4 ? 2 : 1;
  args.tiles = int64_t{args.groups} * args.batch * args.l_tiles / args.team;
  const int64_t teams =
      std::max<int64_t>(1, std::min<int64_t>(args.tiles, int64_t{shape.blocks_per_sm} * shape.sms / args.team));
  kernel<<<static_cast<unsigned>(teams * args.team), threads, smem, at::cuda::getCurrentCUDAStream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// 16-bit, two tilings: 128 positions, one block per SM (16 warps over more than 16 rows, else 8);
// for at most 64 positions per sample, where half of such a tile would be idle, 64 positions with
// two blocks per SM (slower on long samples: twice the tiles, and the 128-register limit of two
// blocks spills at K > 80). fp32: 64 positions
// (the same 16-byte chunks per row), one block per SM for the A fragments' registers. False: the
// tile does not fit the GPU's shared memory (K > 112 on sm_80's 163 KB).
template <typename T, int kKSteps>
bool launch_variant(const ApplyArgs<T>& args) {
  if constexpr (std::is_same_v<T, float>) {
    return launch_apply<T, kKSteps, 64, 3, 1>(args);
  } else {
    if (args.length <= 64) return launch_apply<T, kKSteps, 64, 4, 2>(args);
    if (args.rows > 16) return launch_apply<T, kKSteps, 128, 3, 1, 8>(args);
    return launch_apply<T, kKSteps, 128, 3, 1>(args);
  }
}

template <typename T>
bool dispatch_apply(const ApplyArgs<T>& args) {
  switch ((args.depth + 15) / 16) {
    case 1: return launch_variant<T, 1>(args);
    case 2: return launch_variant<T, 2>(args);
    case 3: return launch_variant<T, 3>(args);
    case 4: return launch_variant<T, 4>(args);
    case 5: return launch_variant<T, 5>(args);
    case 6: return launch_variant<T, 6>(args);
    case 7: return launch_variant<T, 7>(args);
    default: return launch_variant<T, 8>(args);
  }
}

template <typename T>
bool run_apply(const at::Tensor& matrix, const at::Tensor& x, const std::optional<at::Tensor>& bias,
               const at::Tensor& out) {
  ApplyArgs<T> a;
  a.x = static_cast<const T*>(x.const_data_ptr());
  a.x_b = x.stride(0), a.x_g = x.stride(1), a.x_k = x.stride(2);
  a.matrix = static_cast<const T*>(matrix.const_data_ptr());
  a.m_g = matrix.stride(0), a.m_m = matrix.stride(1), a.m_k = matrix.stride(2);
  a.bias = bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr;
  a.bias_g = bias ? bias->stride(0) : 0, a.bias_m = bias ? bias->stride(1) : 0;
  a.out = static_cast<T*>(out.data_ptr());
  a.out_b = out.stride(0), a.out_g = out.stride(1), a.out_m = out.stride(2);
  a.batch = static_cast<int>(x.size(0));
  a.rows = static_cast<int>(matrix.size(1));
  a.depth = static_cast<int>(x.size(2));
  a.length = static_cast<int>(x.size(3));
  a.groups = static_cast<int>(x.size(1));
  return dispatch_apply(a);
}

template <typename T>
void run_weight_grad(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& grad_w,
                     const at::Tensor& grad_b) {
  GradArgs<T> a;
  a.dy = static_cast<const T*>(grad_y.const_data_ptr());
  a.dy_b = grad_y.stride(0), a.dy_g = grad_y.stride(1), a.dy_m = grad_y.stride(2);
  a.x = static_cast<const T*>(x.const_data_ptr());
  a.x_b = x.stride(0), a.x_g = x.stride(1), a.x_k = x.stride(2);
  a.groups = static_cast<int>(x.size(1));
  a.rows = static_cast<int>(grad_y.size(2));
  a.depth = static_cast<int>(x.size(2));
  a.length = static_cast<int>(x.size(3));
  a.l_tiles = (a.length + kGradTileL - 1) / kGradTileL;
  a.slices = static_cast<int>(x.size(0) * a.l_tiles);
  a.columns = a.depth + (grad_b.defined() ? 1 : 0);
  constexpr int smem = 2 * kGradStages * kGradSlot * 2;
  const auto kernel = small_group_weight_grad_kernel<T>;
  const LaunchShape shape = prepare_launch(reinterpret_cast<const void*>(kernel), kThreads, smem);
  TORCH_CHECK(shape.blocks_per_sm > 0, "small_group_weight_grad: ", smem,
              " bytes of shared memory fit no block on this GPU");
  // The ranges per group: the count of at most 16, each of at least 4 slices, whose blocks finish in
  // the fewest waves of resident blocks for the work (waves / splits), the smaller on ties.
  const int64_t resident = int64_t{shape.blocks_per_sm} * shape.sms;
  int64_t splits = 1;
  for (int64_t s = 2; s <= std::min<int64_t>(16, a.slices / 4); ++s) {
    const int64_t waves = (a.groups * s + resident - 1) / resident,
                  best = (a.groups * splits + resident - 1) / resident;
    if (waves * splits < best * s) splits = s;
  }
  at::Tensor partial, arrivals;  // (kept alive until the launch is queued)
  if (splits > 1) {
    partial = at::empty({splits, a.groups, (int64_t{a.rows} * a.columns + 3) / 4 * 4}, x.options().dtype(at::kFloat));
    arrivals = at::zeros({a.groups}, x.options().dtype(at::kInt));
    a.partial = partial.data_ptr<float>();
    a.arrivals = arrivals.data_ptr<int>();
  }
  a.grad_w = static_cast<T*>(grad_w.data_ptr());
  a.grad_b = grad_b.defined() ? static_cast<T*>(grad_b.data_ptr()) : nullptr;
  kernel<<<dim3(static_cast<unsigned>(splits), static_cast<unsigned>(a.groups)), kThreads, smem,
           at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool small_group_apply(const at::Tensor& matrix, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       const at::Tensor& out, std::string& why) {
  if (!common_checks(x, matrix.size(1), x.size(2), /*fp32=*/true, why, {x, out})) return false;
  if (x.size(1) >= 65536) return decline(why, "at most 65535 groups");
  const c10::cuda::CUDAGuard guard(x.device());
  const bool ran = x.scalar_type() == at::kHalf       ? run_apply<__half>(matrix, x, bias, out)
                   : x.scalar_type() == at::kBFloat16 ? run_apply<__nv_bfloat16>(matrix, x, bias, out)
                                                      : run_apply<float>(matrix, x, bias, out);
  return ran || decline(why, "the tile for this K needs more shared memory than this GPU has");
}

bool small_group_weight_grad(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& grad_w,
                             const at::Tensor& grad_b, std::string& why) {
  if (!common_checks(x, grad_y.size(2), x.size(2), /*fp32=*/false, why, {x, grad_y})) return false;
  TORCH_CHECK(!grad_b.defined() || x.size(2) < kMaxRows,
              "small_group_weight_grad: the bias gradient's column needs K < ", kMaxRows, ", got K = ", x.size(2));
  TORCH_CHECK(grad_w.is_contiguous() && (!grad_b.defined() || grad_b.is_contiguous()),
              "small_group_weight_grad: grad_w and grad_b must be contiguous");
  if (x.size(0) * ((x.size(3) + kGradTileL - 1) / kGradTileL) >= INT_MAX)
    return decline(why, "sizes past 32-bit indices");
  if (x.size(1) >= 65536) return decline(why, "at most 65535 groups");
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.scalar_type() == at::kHalf) {
    run_weight_grad<__half>(grad_y, x, grad_w, grad_b);
  } else {
    run_weight_grad<__nv_bfloat16>(grad_y, x, grad_w, grad_b);
  }
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
