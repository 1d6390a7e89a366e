// Gather (patchify) and scatter (unpatchify) kernels.
//
// One thread block moves one tile: T consecutive patches along w, times Hc patch rows along h
// (fixed b, nd), times a chunk of Cc channels. The tile passes through shared memory in the patch
// matrix's layout, so both global sides are coalesced: the volume side moves runs of T*kw
// contiguous elements per (patch row, c, i, j) row (T*kw*C for channels-last input), the
// patch-matrix side Cc*kd*kh*kw contiguous elements per token. Both sides use 16-byte vectors
// where alignment allows (the gather's volume side always: aligned vectors covering each run; else
// 4-byte pairs of 16-bit elements, or single elements), with 8 independent accesses in flight per
// thread; per-tile offset tables and a multiply-high divide keep the index math off the critical
// path. The shared-memory row pitch is odd in units, so the transposing side is free of bank
// conflicts. The file also holds the batched transpose between tokens and channels-first layouts
// (transposing_copy) and the padded weight of the GEMM paths (pad_weight).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "kernels/patch/patchify.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxLevels = 4;
constexpr int64_t kTileBytes = 24 * 1024;    // shared memory per tile (several blocks per SM)
constexpr int64_t kMinRunBytes = 256;        // volume-side contiguous bytes per row we aim for
constexpr int64_t kMinTileBytes = 4096;      // below this, a tile grows along w where blocks are many
constexpr int kMinBlocksPerSm = 1;           // tiles of several rounds are split until the grid has this many per SM

// Row of token (nd, nh, nw) within its batch: the digits of each grid coordinate, one per level
// (coarse first), weighted by the level-major row strides. A tile fixes (nd, nh), so the kernels
// take the (nd, nh) part once per tile and only the w part per token.
struct TokenOrder {
  int levels = 1;
  int size[kMaxLevels][3] = {};
  int64_t row_stride[kMaxLevels][3] = {};
};

__device__ __forceinline__ int64_t rows_of_dim(const TokenOrder& o, int d, int n) {
  int64_t row = 0;
  for (int l = o.levels - 1; l >= 0; --l) {
    const int s = o.size[l][d];
    row += (n % s) * o.row_stride[l][d];
    n /= s;
  }
  return row;
}

__device__ __forceinline__ int64_t w_rows(const TokenOrder& o, int nw) {
  return o.levels == 1 ? int64_t{nw} : rows_of_dim(o, 2, nw);
}

// Everything in "units" (the data moved per access: 1 or 2 elements).
struct Tiling {
  int64_t vol_stride[4] = {};  // of the volume [B, C, D, H]; W has unit stride (channels-first)
                               // or C elements (channels-last, where units are elements)
  int channels = 0;            // C
  int kd = 1, kh = 1, kw = 1;  // kw in units (channels-first)
  int kw_shift = -1;           // log2(kw) if kw is a power of two
  int grid[3] = {};
  int tile_tokens = 1;         // T: tokens along w per patch row
  int tile_rows = 1;           // Hc: patch rows (along h) per tile
  int tile_channels = 1;       // Cc
  int w_tiles = 1, h_tiles = 1, c_tiles = 1;
  int64_t ld = 0;              // patch-matrix row stride
  int64_t tokens = 0;          // N
  bool volume_vectors = false; // volume row starts are 16-byte aligned given an aligned origin
  bool full_rows = false;      // gather tiles holding every channel: P's whole rows (padding
                               // included, staged in shared memory) leave as 16-byte vectors
  TokenOrder order;
};

constexpr int kMaxTileTokens = 256;  // Hc * T
constexpr int kMaxTileRows = 1024;   // volume rows per tile: Hc * Cc * kd * kh
constexpr int kBatch = 8;            // independent loads in flight per thread

// n / d and n % d for 0 <= n < 2^31 by multiply-high (Granlund-Montgomery), d fixed per block.
struct FastDiv {
  unsigned d, magic, shift;
  __device__ explicit FastDiv(unsigned divisor) : d(divisor) {
    shift = 0;
    while ((1u << shift) < d) ++shift;
    magic = static_cast<unsigned>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, magic) + n) >> shift; }
};

struct Tile {
  int64_t b;
  int nd, nh0, nw0;
  int hc, count;  // patch rows and tokens per row in this tile (the last ones may be short)
  int c0, cc;     // channel range
  __device__ int tokens() const { return hc * count; }
};

__device__ __forceinline__ Tile decode_tile(const Tiling& t) {
  unsigned i = blockIdx.x;  // the block count is below 2^31 (checked on the host)
  Tile tile;
  const unsigned ct = i % t.c_tiles;
  i /= t.c_tiles;
  const unsigned wt = i % t.w_tiles;
  i /= t.w_tiles;
  const unsigned ht = i % t.h_tiles;
  i /= t.h_tiles;
  tile.nd = static_cast<int>(i % t.grid[0]);
  tile.b = i / t.grid[0];
  tile.nh0 = static_cast<int>(ht) * t.tile_rows;
  tile.hc = min(t.tile_rows, t.grid[1] - tile.nh0);
  tile.nw0 = static_cast<int>(wt) * t.tile_tokens;
  tile.count = min(t.tile_tokens, t.grid[2] - tile.nw0);
  tile.c0 = static_cast<int>(ct) * t.tile_channels;
  tile.cc = min(t.tile_channels, t.channels - tile.c0);
  return tile;
}

// The per-tile tables: each token's patch-matrix row, and each volume row's offset (from the
// tile's origin), shared-memory offset and channel. Volume rows are (hl, c, i, j) channels-first,
// (hl, i, j) channels-last.
struct Tables {
  int64_t token_row[kMaxTileTokens];
  int64_t vol_off[kMaxTileRows];
  int smem_off[kMaxTileRows];
  int chan[kMaxTileRows];
};

template <bool kChannelsLast>
__device__ __forceinline__ int fill_tables(Tables& tb, const Tiling& t, const Tile& tl, int pitch) {
  const int64_t row0 = tl.b * t.tokens + rows_of_dim(t.order, 0, tl.nd);
  for (int tok = threadIdx.x; tok < tl.tokens(); tok += kThreads) {
    const int hl = tok / tl.count, w = tok - hl * tl.count;
    tb.token_row[tok] = row0 + rows_of_dim(t.order, 1, tl.nh0 + hl) + w_rows(t.order, tl.nw0 + w);
  }
  const int per_hl = (kChannelsLast ? 1 : tl.cc) * t.kd * t.kh;
  const int rows = tl.hc * per_hl;
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    const int hl = r / per_hl, cij = r - hl * per_hl;
    const int j = cij % t.kh, ci = cij / t.kh, i = ci % t.kd, c = ci / t.kd;
    tb.vol_off[r] = c * t.vol_stride[1] + i * t.vol_stride[2] +
                    (int64_t{hl} * t.kh + j) * t.vol_stride[3];
    tb.smem_off[r] = hl * tl.count * pitch + cij * t.kw;
    tb.chan[r] = tl.c0 + c;
  }
  return rows;
}

__device__ __forceinline__ int64_t tile_origin(const Tiling& t, const Tile& tl, int64_t w_step) {
  return tl.b * t.vol_stride[0] + int64_t{tl.c0} * t.vol_stride[1] +
         int64_t{tl.nd} * t.kd * t.vol_stride[2] + int64_t{tl.nh0} * t.kh * t.vol_stride[3] +
         int64_t{tl.nw0} * w_step;
}

// 16 bytes of units, the access width of both global sides where alignment allows.
template <typename Unit>
struct alignas(16) Vec {
  static constexpr int kUnits = 16 / sizeof(Unit);
  Unit u[kUnits];
};

// Volume side of a channels-first tile: rows x (count * kw) contiguous units, moved as V-unit
// vectors (V = 16 bytes, or 1 unit), kBatch accesses in flight per thread. kToTile: volume -> tile
// (gather), else tile (+ bias) -> volume (scatter).
template <typename Unit, typename scalar_t, bool kToTile, int V>
__device__ __forceinline__ void volume_side(Unit* vol, Unit* tile, const Tables& tb, int rows,
                                            int pitch, const Tiling& t, const Tile& tl,
                                            const scalar_t* bias) {
  using Vector = std::conditional_t<V == 1, Unit, Vec<Unit>>;
  const int run = tl.count * t.kw, vectors = run / V;
  const FastDiv by_row(vectors);
  const int total = rows * vectors;
  for (int i0 = threadIdx.x; i0 < total; i0 += kThreads * kBatch) {
    Vector v[kBatch];
    int r[kBatch], e0[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int idx = i0 + k * kThreads;
      if (idx < total) {
        r[k] = by_row.div(idx);
        e0[k] = (idx - r[k] * vectors) * V;
        if (kToTile) v[k] = reinterpret_cast<const Vector*>(vol + tb.vol_off[r[k]])[e0[k] / V];
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (i0 + k * kThreads >= total) continue;
      int tok = t.kw_shift >= 0 ? e0[k] >> t.kw_shift : e0[k] / t.kw;
      int l = e0[k] - tok * t.kw;
      Unit* units = reinterpret_cast<Unit*>(&v[k]);
      using opmath_t = at::opmath_type<scalar_t>;
      const opmath_t b = !kToTile && bias ? static_cast<opmath_t>(bias[tb.chan[r[k]]]) : opmath_t(0);
#pragma unroll
      for (int q = 0; q < V; ++q) {
        Unit& s = tile[tb.smem_off[r[k]] + tok * pitch + l];
        if (kToTile) {
          s = units[q];
        } else {
          units[q] = s;
          if (bias) {
            scalar_t* e = reinterpret_cast<scalar_t*>(&units[q]);
#pragma unroll
            for (int z = 0; z < static_cast<int>(sizeof(Unit) / sizeof(scalar_t)); ++z) {
              e[z] = static_cast<scalar_t>(static_cast<opmath_t>(e[z]) + b);
            }
          }
        }
        if (++l == t.kw) {
          l = 0;
          ++tok;
        }
      }
      if (!kToTile) reinterpret_cast<Vector*>(vol + tb.vol_off[r[k]])[e0[k] / V] = v[k];
    }
  }
}

// The gather's volume side where rows are not whole aligned vectors (e.g. kw = 7 in 16 bits, or a
// row stride of 28 elements): each row's run of count * kw units is read as the aligned 16-byte
// vectors from the one holding its first unit to the one holding its last, and the units outside
// the run are dropped. Every vector read is the 16-byte aligned chunk of a unit of x: it cannot
// cross a page, and it lies in x's block of the caching allocator (whose blocks are multiples of
// 512 bytes, so memcheck sees no read outside them). Reads only: the scatter cannot write past
// its runs.
template <typename Unit>
__device__ __forceinline__ void volume_to_tile_any_alignment(const Unit* vol, Unit* tile, const Tables& tb, int rows,
                                                             int pitch, const Tiling& t, const Tile& tl) {
  constexpr int V = Vec<Unit>::kUnits;
  const int run = tl.count * t.kw;
  const int vectors = (run + 2 * V - 2) / V;  // enough for a run that starts at any unit of a vector
  const FastDiv by_row(vectors);
  const int total = rows * vectors;
  for (int i0 = threadIdx.x; i0 < total; i0 += kThreads * kBatch) {
    Vec<Unit> v[kBatch];
    int r[kBatch], e0[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int idx = i0 + k * kThreads;
      e0[k] = run;  // nothing to store
      if (idx < total) {
        r[k] = by_row.div(idx);
        const Unit* start = vol + tb.vol_off[r[k]];
        const int skew = static_cast<int>(reinterpret_cast<uintptr_t>(start) % 16 / sizeof(Unit));
        const int vector = idx - r[k] * vectors;
        e0[k] = vector * V - skew;  // the run's unit at the vector's first
        if (e0[k] < run) v[k] = reinterpret_cast<const Vec<Unit>*>(start - skew)[vector];
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (e0[k] >= run) continue;
      const int first = max(e0[k], 0);
      int tok = t.kw_shift >= 0 ? first >> t.kw_shift : first / t.kw;
      int l = first - tok * t.kw;
#pragma unroll
      for (int q = 0; q < V; ++q) {  // (static indices keep the vector in registers)
        const int e = e0[k] + q;
        if (e < first || e >= run) continue;
        tile[tb.smem_off[r[k]] + tok * pitch + l] = v[k].u[q];
        if (++l == t.kw) {
          l = 0;
          ++tok;
        }
      }
    }
  }
}

template <typename Unit, typename scalar_t, bool kToTile>
__device__ __forceinline__ void volume_side_any(Unit* vol, Unit* tile, const Tables& tb, int rows,
                                                int pitch, const Tiling& t, const Tile& tl,
                                                const scalar_t* bias) {
  constexpr int V = Vec<Unit>::kUnits;
  // Vectors need 16-byte aligned row starts (the host checked the strides) and whole vectors.
  if (t.volume_vectors && (tl.count * t.kw) % V == 0 &&
      reinterpret_cast<uintptr_t>(vol) % 16 == 0) {
    volume_side<Unit, scalar_t, kToTile, V>(vol, tile, tb, rows, pitch, t, tl, bias);
  } else if constexpr (kToTile) {
    volume_to_tile_any_alignment<Unit>(vol, tile, tb, rows, pitch, t, tl);
  } else {
    volume_side<Unit, scalar_t, kToTile, 1>(vol, tile, tb, rows, pitch, t, tl, bias);
  }
}

// Patch-matrix side: each token owns `row_units` contiguous units at column `col0`, moved as
// V-unit vectors, kBatch accesses in flight per thread.
template <typename Unit, bool kToMatrix, int V>
__device__ __forceinline__ void matrix_rows(Unit* matrix, Unit* tile, const Tables& tb,
                                            int row_units, int pitch, int64_t col0,
                                            const Tiling& t, const Tile& tl) {
  using Vector = std::conditional_t<V == 1, Unit, Vec<Unit>>;
  const int vectors = row_units / V;
  const FastDiv by_row(vectors);
  const int total = tl.tokens() * vectors;
  for (int i0 = threadIdx.x; i0 < total; i0 += kThreads * kBatch) {
    Vector v[kBatch];
    int at[kBatch];
    int64_t g[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int idx = i0 + k * kThreads;
      if (idx < total) {
        const int tok = by_row.div(idx), u = (idx - tok * vectors) * V;
        at[k] = tok * pitch + u;
        g[k] = (tb.token_row[tok] * t.ld + col0 + u) / V;
        Unit* units = reinterpret_cast<Unit*>(&v[k]);
        if (kToMatrix) {
#pragma unroll
          for (int q = 0; q < V; ++q) units[q] = tile[at[k] + q];
        } else {
          v[k] = reinterpret_cast<const Vector*>(matrix)[g[k]];
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (i0 + k * kThreads >= total) continue;
      if (kToMatrix) {
        reinterpret_cast<Vector*>(matrix)[g[k]] = v[k];
      } else {
        const Unit* units = reinterpret_cast<const Unit*>(&v[k]);
#pragma unroll
        for (int q = 0; q < V; ++q) tile[at[k] + q] = units[q];
      }
    }
  }
}

// Writing, the tile holding the last channels also fills each row's padding [pad_begin, ld):
// `pad_first` (the bits of a ones column, or 0), then zeros.
template <typename Unit, bool kToMatrix>
__device__ __forceinline__ void matrix_side(Unit* matrix, Unit* tile, const Tables& tb,
                                            int row_units, int pitch, int64_t col0,
                                            const Tiling& t, const Tile& tl, int64_t pad_begin,
                                            Unit pad_first) {
  constexpr int V = Vec<Unit>::kUnits;
  if (row_units % V == 0 && col0 % V == 0 && t.ld % V == 0 &&
      reinterpret_cast<uintptr_t>(matrix) % 16 == 0) {
    matrix_rows<Unit, kToMatrix, V>(matrix, tile, tb, row_units, pitch, col0, t, tl);
  } else {
    matrix_rows<Unit, kToMatrix, 1>(matrix, tile, tb, row_units, pitch, col0, t, tl);
  }
  if (kToMatrix && !t.full_rows && tl.c0 + tl.cc == t.channels) {
    const int pad = static_cast<int>(t.ld - pad_begin);
    for (int idx = threadIdx.x; idx < tl.tokens() * pad; idx += kThreads) {
      const int tok = idx / pad, u = idx - tok * pad;
      matrix[tb.token_row[tok] * t.ld + pad_begin + u] = u == 0 ? pad_first : Unit(0);
    }
  }
}

// Full-row tiles: each token's padding [values, ld) staged in shared memory, `pad_first` then zeros.
template <typename Unit>
__device__ __forceinline__ void stage_padding(Unit* tile, const Tiling& t, const Tile& tl, int values, int pitch,
                                              Unit pad_first) {
  if (!t.full_rows) return;
  const int pad = static_cast<int>(t.ld) - values;
  for (int idx = threadIdx.x; idx < tl.tokens() * pad; idx += kThreads) {
    const int tok = idx / pad, u = idx - tok * pad;
    tile[tok * pitch + values + u] = u == 0 ? pad_first : Unit(0);
  }
}

// Units a token's row holds in the tile: its values, or P's whole row.
__device__ __forceinline__ int tile_row_units(const Tiling& t, int values) {
  return t.full_rows ? static_cast<int>(t.ld) : values;
}

template <typename Unit>
__global__ void __launch_bounds__(kThreads)
    gather_channels_first(const Unit* __restrict__ x, Unit* __restrict__ p, int64_t pad_begin,
                          Unit pad_first, const Tiling t) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Tables tb;
  Unit* tile = reinterpret_cast<Unit*>(smem);
  const Tile tl = decode_tile(t);
  const int values = tl.cc * t.kd * t.kh * t.kw, row_units = tile_row_units(t, values), pitch = row_units | 1;
  const int rows = fill_tables<false>(tb, t, tl, pitch);
  stage_padding(tile, t, tl, values, pitch, pad_first);
  __syncthreads();
  volume_side_any<Unit, float, true>(const_cast<Unit*>(x) + tile_origin(t, tl, t.kw), tile, tb,
                                     rows, pitch, t, tl, nullptr);
  __syncthreads();
  matrix_side<Unit, true>(p, tile, tb, row_units, pitch, int64_t{tl.c0} * t.kd * t.kh * t.kw, t,
                          tl, pad_begin, pad_first);
}

// Channels-last volume (c contiguous, w stride C): units are single elements and every tile holds
// all channels, so a (hl, i, j) row is one run of T*kw*C contiguous elements.
template <typename Unit>
__global__ void __launch_bounds__(kThreads)
    gather_channels_last(const Unit* __restrict__ x, Unit* __restrict__ p, int64_t pad_begin,
                         Unit pad_first, const Tiling t) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Tables tb;
  Unit* tile = reinterpret_cast<Unit*>(smem);
  const Tile tl = decode_tile(t);
  const int C = t.channels, per_channel = t.kd * t.kh * t.kw;
  const int values = C * per_channel, row_units = tile_row_units(t, values), pitch = row_units | 1;
  const int rows = fill_tables<true>(tb, t, tl, pitch);
  stage_padding(tile, t, tl, values, pitch, pad_first);
  __syncthreads();
  const Unit* base = x + tile_origin(t, tl, int64_t{t.kw} * C);
  const int run = tl.count * t.kw * C;
  const FastDiv by_run(run), by_c(C);
  const int total = rows * run;
  for (int i0 = threadIdx.x; i0 < total; i0 += kThreads * kBatch) {
    Unit v[kBatch];
    int at[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int idx = i0 + k * kThreads;
      if (idx < total) {
        const int r = by_run.div(idx), e = idx - r * run;
        const int w = by_c.div(e), c = e - w * C;
        const int tok = t.kw_shift >= 0 ? w >> t.kw_shift : w / t.kw;
        at[k] = tb.smem_off[r] + tok * pitch + c * per_channel + (w - tok * t.kw);
        v[k] = base[tb.vol_off[r] + e];
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (i0 + k * kThreads < total) tile[at[k]] = v[k];
    }
  }
  __syncthreads();
  matrix_side<Unit, true>(p, tile, tb, row_units, pitch, 0, t, tl, pad_begin, pad_first);
}

// y (contiguous, channels-first) = the tile's patches (+ bias per channel).
template <typename scalar_t, typename Unit>
__global__ void __launch_bounds__(kThreads)
    scatter_channels_first(const Unit* __restrict__ q, Unit* __restrict__ y,
                           const scalar_t* __restrict__ bias, const Tiling t) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Tables tb;
  Unit* tile = reinterpret_cast<Unit*>(smem);
  const Tile tl = decode_tile(t);
  const int row_units = tl.cc * t.kd * t.kh * t.kw, pitch = row_units | 1;
  const int rows = fill_tables<false>(tb, t, tl, pitch);
  __syncthreads();
  matrix_side<Unit, false>(const_cast<Unit*>(q), tile, tb, row_units, pitch,
                           int64_t{tl.c0} * t.kd * t.kh * t.kw, t, tl, 0, Unit(0));
  __syncthreads();
  volume_side_any<Unit, scalar_t, false>(y + tile_origin(t, tl, t.kw), tile, tb, rows, pitch, t,
                                         tl, bias);
}

// Channels-first x whose patch rows are whole 16-byte vectors (kw and every stride a multiple of
// 16 bytes), plain token order: no tile. Each thread copies 16-byte vectors straight from x to P; a
// warp's 32 vectors are 512 contiguous bytes of P and whole 32-byte sectors of x (runs of kw
// elements), so both sides move full sectors without the shared-memory pass, which the
// tiled gather pays for.
struct WideRows {
  int64_t stride[4];             // of x [B, C, D, H] in vectors
  int kd, kh, kw;                // the patch; kw in vectors
  int tokens, gw, gh, K, row_vectors;  // K in vectors; row_vectors: P's row (ld) in vectors
  uint64_t one_bits;             // the padding's first element (1 for a ones column, else 0)
};

__global__ void __launch_bounds__(kThreads)
    gather_wide_rows(const uint4* __restrict__ x, uint4* __restrict__ p, const WideRows w, int total) {
  __shared__ int source[1024];  // per vector of a P row: its offset from the patch's first vector; -1: padding
  for (int v = threadIdx.x; v < w.row_vectors; v += kThreads) {
    int offset = -1;
    if (v < w.K) {
      const int l = v % w.kw, r = v / w.kw, j = r % w.kh, i = r / w.kh % w.kd, c = r / w.kh / w.kd;
      offset = static_cast<int>(c * w.stride[1] + i * w.stride[2] + j * w.stride[3] + l);
    }
    source[v] = offset;
  }
  __syncthreads();
  const FastDiv by_row(w.row_vectors), by_tokens(w.tokens), by_gw(w.gw), by_gh(w.gh);
  const uint4 padding = {static_cast<unsigned>(w.one_bits), static_cast<unsigned>(w.one_bits >> 32), 0, 0};
  for (int idx = blockIdx.x * kThreads + threadIdx.x; idx < total; idx += gridDim.x * kThreads) {
    const int row = by_row.div(idx), v = idx - row * w.row_vectors, offset = source[v];
    if (offset < 0) {
      p[idx] = v == w.K ? padding : uint4{0, 0, 0, 0};
      continue;
    }
    const int b = by_tokens.div(row), n = row - b * w.tokens, r = by_gw.div(n), nw = n - r * w.gw;
    const int nd = by_gh.div(r), nh = r - nd * w.gh;
    p[idx] = x[b * w.stride[0] + int64_t{nd} * w.kd * w.stride[2] + int64_t{nh} * w.kh * w.stride[3] +
               int64_t{nw} * w.kw + offset];
  }
}

// w = [w2 | bias | 0]. Units are raw bits (a copy needs no arithmetic, and zero bits are 0 in every
// float type). Each thread writes V consecutive units of a row (V: 16 bytes of units, one vector
// store, where w's rows are 16-byte aligned; else 1) and locates them with one division: the
// weight moves near the memory's speed, where one unit per thread, each indexed by a 64-bit
// division, ran at a sixth of it.
template <typename Unit, int V>
__global__ void __launch_bounds__(kThreads)
    pad_weight_kernel(const Unit* __restrict__ w2, int64_t row_stride, int64_t col_stride,
                      const Unit* __restrict__ bias, int64_t K, int64_t width, int64_t rows, Unit* __restrict__ w) {
  static_assert(V == 1 || V * sizeof(Unit) == 16, "a vector is 16 bytes");
  const int64_t per_row = width / V, total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const int64_t r = i / per_row, c0 = (i - r * per_row) * V;
    alignas(16) Unit units[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t c = c0 + j;
      units[j] = c < K ? w2[r * row_stride + c * col_stride] : c == K && bias ? bias[r] : Unit(0);
    }
    if constexpr (V == 1) {
      w[r * width + c0] = units[0];
    } else {
      *reinterpret_cast<uint4*>(w + r * width + c0) = *reinterpret_cast<const uint4*>(units);
    }
  }
}

// A batched 2-D transpose of memory, the layout change between tokens [B, N, C] and channels-first
// [B, C, N]: dst(b, i, j) = src(b, i, j), where src's unit-stride dim is i and dst's is j. One block
// moves a 64 x 64 tile through shared memory, so both sides are coalesced: it reads VI-unit vectors
// along src's rows and writes VO-unit vectors along dst's rows (16 bytes, or 4, or one unit, as the
// alignment allows). The tile's odd row pitch (65 units) spreads the column reads over the banks.
constexpr int kTransposeTile = 64;
constexpr int kTransposePitch = kTransposeTile + 1;

struct TransposeShape {
  int rows, cols;                   // i's and j's extents
  int64_t src_batch, src_ld;        // src(b, i, j) at b * src_batch + j * src_ld + i
  int64_t dst_batch, dst_ld;        // dst(b, i, j) at b * dst_batch + i * dst_ld + j
  int64_t batch;
  int col_tiles;
};

// V units moved as one access (16 bytes, 4, or one unit).
template <typename Unit, int V>
struct alignas(V * sizeof(Unit)) Units {
  Unit u[V];
};

template <typename Unit, int VI, int VO>
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks an SM: enough loads in flight
    transpose_tiles(const Unit* __restrict__ src, Unit* __restrict__ dst, const TransposeShape s) {
  // A thread's accesses: a fixed column of the tile, every (kThreads / per_row)-th row from its first.
  constexpr int kInPerRow = kTransposeTile / VI, kInRowStep = kThreads / kInPerRow;
  constexpr int kOutPerRow = kTransposeTile / VO, kOutRowStep = kThreads / kOutPerRow;
  constexpr int kLoads = kTransposeTile / kInRowStep, kStores = kTransposeTile / kOutRowStep;
  __shared__ Unit tile[kTransposeTile * kTransposePitch];  // tile[j * pitch + i]
  const int i0 = static_cast<int>(blockIdx.x / s.col_tiles) * kTransposeTile;
  const int j0 = static_cast<int>(blockIdx.x % s.col_tiles) * kTransposeTile;
  const int rows = min(kTransposeTile, s.rows - i0), cols = min(kTransposeTile, s.cols - j0);
  const int in_i = threadIdx.x % kInPerRow * VI, in_j = threadIdx.x / kInPerRow;
  const int out_j = threadIdx.x % kOutPerRow * VO, out_i = threadIdx.x / kOutPerRow;
  for (int64_t b = blockIdx.y; b < s.batch; b += gridDim.y) {
    // src rows j (i runs along them); rows % VI == 0 (host), so a vector is all in or all out.
    const Unit* from = src + b * s.src_batch + (j0 + in_j) * s.src_ld + i0 + in_i;
    Units<Unit, VI> v[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      if (in_i < rows && in_j + k * kInRowStep < cols) {
        v[k] = *reinterpret_cast<const Units<Unit, VI>*>(from + k * kInRowStep * s.src_ld);
      }
    }
    // (Positions past the tile's rows or columns take values the stores below never read.)
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
#pragma unroll
      for (int q = 0; q < VI; ++q) tile[(in_j + k * kInRowStep) * kTransposePitch + in_i + q] = v[k].u[q];
    }
    __syncthreads();
    // dst rows i (j runs along them); cols % VO == 0 (host).
    Unit* to = dst + b * s.dst_batch + (i0 + out_i) * s.dst_ld + j0 + out_j;
#pragma unroll
    for (int k = 0; k < kStores; ++k) {
      if (out_j < cols && out_i + k * kOutRowStep < rows) {
        Units<Unit, VO> out;
#pragma unroll
        for (int q = 0; q < VO; ++q) out.u[q] = tile[(out_j + q) * kTransposePitch + out_i + k * kOutRowStep];
        *reinterpret_cast<Units<Unit, VO>*>(to + k * kOutRowStep * s.dst_ld) = out;
      }
    }
    __syncthreads();
  }
}

// ---- host side ----------------------------------------------------------------------------------

// f(std::integral_constant<int, v>) for an access width v of 16 bytes, 4 bytes (a pair of 16-bit
// units) or one unit: the transpose's widths as template arguments.
template <typename Unit, typename F>
void with_access_width(int v, F&& f) {
  constexpr int kWide = 16 / sizeof(Unit), kPair = sizeof(Unit) == 2 ? 2 : 1;
  if (v == kWide) {
    f(std::integral_constant<int, kWide>{});
  } else if (v == kPair) {
    f(std::integral_constant<int, kPair>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

int64_t stride_or_zero(const at::Tensor& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }

int sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

TokenOrder token_order(const PatchGeometry& g) {
  TokenOrder o;
  o.levels = static_cast<int>(g.levels.size());
  int64_t stride = 1;
  for (int l = o.levels - 1; l >= 0; --l) {
    for (int d = 2; d >= 0; --d) {
      o.size[l][d] = static_cast<int>(g.levels[l][d]);
      o.row_stride[l][d] = stride;
      stride *= g.levels[l][d];
    }
  }
  return o;
}

// Elements per unit: 2 for 16-bit data when every offset the kernel forms is even, else 1.
int elements_per_unit(const at::Tensor& vol, const at::Tensor& matrix, const PatchGeometry& g) {
  if (vol.element_size() != 2 || g.kernel[2] % 2 != 0) return 1;
  if (reinterpret_cast<uintptr_t>(vol.data_ptr()) % 4 || reinterpret_cast<uintptr_t>(matrix.data_ptr()) % 4)
    return 1;
  for (int d = 0; d < 4; ++d) {
    if (stride_or_zero(vol, d) % 2) return 1;
  }
  return matrix.stride(1) % 2 == 0 ? 2 : 1;
}

// Tile sizes: enough tokens along w for long contiguous volume runs (a whole number of 16-byte
// vectors where the row allows it), then as many channels as fit the shared-memory budget, then
// (when all channels fit) several patch rows, so that small patches still give every block real
// work. A gather (`gather`) whose tiles hold every channel writes P's whole rows, padding included.
// Then the tiles are resized to the GPU (`sm_count` SMs): where the blocks are fewer than the SMs,
// tiles that take their threads several rounds of loads are split, and long thin problems (1-D, few
// channels), whose tiles of a few hundred bytes made thousands of blocks doing little beyond their
// setup, grow along w.
// False if one channel of one patch does not fit.
bool plan_tiles(Tiling& t, const PatchGeometry& g, int64_t unit_bytes, bool all_channels, bool gather, int sm_count) {
  for (int d = 0; d < 3; ++d) {
    if (g.grid[d] > INT_MAX) return false;
  }
  const int64_t kdkh = g.kernel[0] * g.kernel[1];
  const int64_t per_channel = kdkh * t.kw;  // units
  const int64_t budget = kTileBytes / unit_bytes;
  const int64_t run_tokens = (kMinRunBytes + t.kw * unit_bytes - 1) / (t.kw * unit_bytes);
  int64_t tokens = std::min<int64_t>({g.grid[2], kMaxTileTokens, std::max<int64_t>(1, run_tokens)});
  // As many tiles along w, of equal tokens; where the volume's rows take 16-byte vectors, of
  // whole groups of tokens that are 16-byte runs.
  const int64_t group = t.volume_vectors ? 16 / std::gcd<int64_t>(t.kw * unit_bytes, 16) : 1;
  if (tokens < g.grid[2] && tokens > group) {
    const int64_t tiles = (g.grid[2] + tokens - 1) / tokens, even = (g.grid[2] + tiles - 1) / tiles;
    tokens = std::min<int64_t>({g.grid[2], kMaxTileTokens, (even + group - 1) / group * group});
  }
  int64_t channels = all_channels
                         ? g.channels
                         : std::min<int64_t>({g.channels, std::max<int64_t>(1, budget / (tokens * per_channel)),
                                              std::max<int64_t>(1, kMaxTileRows / kdkh)});
  // A tile of some of the channels moves each token's slice of P as 16-byte vectors only if the
  // slice is whole vectors (its start is then too): e.g. 7 x 7 patches of 16-bit values take
  // channels in multiples of 8, else every unit of P is a store of its own.
  const int64_t channel_step = 16 / std::gcd<int64_t>(per_channel * unit_bytes, 16);
  const auto whole_vectors = [&](int64_t c) {
    return c < g.channels && c >= channel_step ? c / channel_step * channel_step : c;
  };
  channels = whole_vectors(channels);
  t.full_rows = gather && channels == g.channels && (t.ld | 1) <= budget;
  const auto token_units = [&] { return (t.full_rows ? t.ld : channels * per_channel) | 1; };
  while (tokens > 1 && tokens * token_units() > budget) tokens = (tokens + 1) / 2;
  const int64_t tile_units = tokens * token_units();
  const int64_t rows_per_patch_row = (all_channels ? 1 : channels) * kdkh;
  if (tile_units > budget || rows_per_patch_row > kMaxTileRows) return false;
  int64_t patch_rows = 1;
  if (channels == g.channels) {
    patch_rows = std::min<int64_t>({g.grid[1], budget / tile_units, kMaxTileTokens / tokens,
                                    kMaxTileRows / rows_per_patch_row});
    patch_rows = std::max<int64_t>(1, patch_rows);
  }
  const int64_t min_blocks = int64_t{kMinBlocksPerSm} * sm_count;
  const auto blocks = [&](int64_t w_tokens) {
    return g.batch * g.grid[0] * ((g.grid[1] + patch_rows - 1) / patch_rows) * ((g.grid[2] + w_tokens - 1) / w_tokens) *
           ((g.channels + channels - 1) / channels);
  };
  // Too few blocks, each walking its tile in several dependent rounds of loads (kBatch per thread)
  // while SMs idle: split. (A tile of one round gains nothing from the split but its setup again.)
  // Patch rows go first (a tile of several holds every channel), then channels where tiles need
  // not hold them all.
  while (blocks(tokens) < min_blocks && patch_rows * tokens * token_units() > kThreads * kBatch &&
         (patch_rows > 1 || (!all_channels && channels > 1))) {
    if (patch_rows > 1) {
      patch_rows = (patch_rows + 1) / 2;
    } else {
      channels = whole_vectors((channels + 1) / 2);
      t.full_rows = false;
    }
  }
  // Tiny tiles in great numbers: longer runs along w while enough blocks remain.
  const int64_t max_tokens = std::min<int64_t>(g.grid[2], kMaxTileTokens / patch_rows);
  while (patch_rows * tokens * token_units() * unit_bytes < kMinTileBytes && 2 * tokens <= max_tokens &&
         2 * patch_rows * tokens * token_units() <= budget && blocks(2 * tokens) >= min_blocks) {
    tokens *= 2;
  }
  t.tile_tokens = static_cast<int>(tokens);
  t.tile_channels = static_cast<int>(channels);
  t.tile_rows = static_cast<int>(patch_rows);
  t.w_tiles = static_cast<int>((g.grid[2] + tokens - 1) / tokens);
  t.h_tiles = static_cast<int>((g.grid[1] + patch_rows - 1) / patch_rows);
  t.c_tiles = static_cast<int>((g.channels + channels - 1) / channels);
  return blocks(tokens) <= INT_MAX;
}

int64_t tile_blocks(const Tiling& t, const PatchGeometry& g) {
  return g.batch * g.grid[0] * int64_t{t.h_tiles} * t.w_tiles * t.c_tiles;
}

int64_t smem_bytes(const Tiling& t, int64_t unit_bytes) {
  const int64_t row_units = t.full_rows ? t.ld : int64_t{t.tile_channels} * t.kd * t.kh * t.kw;
  return int64_t{t.tile_rows} * t.tile_tokens * (row_units | 1) * unit_bytes;
}

Tiling base_tiling(const at::Tensor& vol, const at::Tensor& matrix, const PatchGeometry& g,
                   int per_unit) {
  Tiling t;
  for (int d = 0; d < 4; ++d) t.vol_stride[d] = stride_or_zero(vol, d) / per_unit;
  TORCH_INTERNAL_ASSERT(g.channels <= INT_MAX && g.kernel[0] * g.kernel[1] * g.kernel[2] <= INT_MAX);
  t.channels = static_cast<int>(g.channels);
  t.kd = static_cast<int>(g.kernel[0]);
  t.kh = static_cast<int>(g.kernel[1]);
  t.kw = static_cast<int>(g.kernel[2] / per_unit);
  t.kw_shift = (t.kw & (t.kw - 1)) == 0 ? __builtin_ctz(t.kw) : -1;
  for (int d = 0; d < 3; ++d) t.grid[d] = static_cast<int>(g.grid[d]);
  t.ld = matrix.stride(1) / per_unit;
  t.tokens = g.tokens();
  t.order = token_order(g);
  // 16-byte volume vectors: every stride a multiple of 16 bytes (the tile origin is checked per block).
  t.volume_vectors = true;
  for (int d = 1; d < 4; ++d) t.volume_vectors &= (stride_or_zero(vol, d) * vol.element_size()) % 16 == 0;
  return t;
}

// The bit pattern of 1 in `dtype` (as the low bits of a 64-bit word).
uint64_t one_as_bits(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return c10::Half(1.0f).x;
    case at::kBFloat16: return c10::BFloat16(1.0f).x;
    case at::kFloat: { const float one = 1.0f; uint32_t bits; std::memcpy(&bits, &one, 4); return bits; }
    default: { const double one = 1.0; uint64_t bits; std::memcpy(&bits, &one, 8); return bits; }
  }
}

// gather_wide_rows where it applies; false elsewhere.
bool gather_wide(const at::Tensor& x5, const PatchGeometry& g, bool ones_column, const at::Tensor& p) {
  const int64_t per_vector = 16 / x5.element_size(), ld = p.stride(1);
  if (g.levels.size() != 1 || x5.stride(4) != 1 || g.kernel[2] % per_vector || ld % per_vector ||
      reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % 16 || reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 ||
      ld / per_vector > 1024 || p.numel() / per_vector >= (1 << 30) || x5.numel() / per_vector >= (1 << 30)) {
    return false;
  }
  WideRows w;
  for (int d = 0; d < 4; ++d) {
    if (stride_or_zero(x5, d) % per_vector) return false;
    w.stride[d] = stride_or_zero(x5, d) / per_vector;
  }
  w.kd = static_cast<int>(g.kernel[0]), w.kh = static_cast<int>(g.kernel[1]);
  w.kw = static_cast<int>(g.kernel[2] / per_vector);
  w.tokens = static_cast<int>(g.tokens()), w.gw = static_cast<int>(g.grid[2]), w.gh = static_cast<int>(g.grid[1]);
  w.K = static_cast<int>(g.patch_size() / per_vector);
  w.row_vectors = static_cast<int>(ld / per_vector);
  w.one_bits = ones_column ? one_as_bits(x5.scalar_type()) : 0;
  const int total = static_cast<int>(p.numel() / per_vector);
  if (total == 0) return true;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads,
                                                        int64_t{sms()} * 8));
  gather_wide_rows<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint4*>(x5.const_data_ptr()), static_cast<uint4*>(p.data_ptr()), w, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace

bool pad_weight(const at::Tensor& w2, const std::optional<at::Tensor>& bias, const at::Tensor& w) {
  if (bias && bias->scalar_type() != w2.scalar_type()) return false;
  TORCH_INTERNAL_ASSERT(w.is_contiguous() && w.dim() == 2);
  const int64_t rows = w.size(0), width = w.size(1), unit = w.element_size();
  if (w.numel() == 0) return true;
  const bool vectors = (width * unit) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0;
  const c10::cuda::CUDAGuard guard(w.device());
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  auto run = [&](auto unit_tag) {
    using Unit = decltype(unit_tag);
    const int64_t threads = vectors ? w.numel() / (16 / sizeof(Unit)) : w.numel();
    const int blocks = static_cast<int>(std::min<int64_t>((threads + kThreads - 1) / kThreads, INT_MAX));
    auto kernel = vectors ? pad_weight_kernel<Unit, 16 / sizeof(Unit)> : pad_weight_kernel<Unit, 1>;
    kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const Unit*>(w2.const_data_ptr()), w2.stride(0), w2.stride(1),
        bias ? static_cast<const Unit*>(b.const_data_ptr()) : nullptr, w2.size(1), width, rows,
        static_cast<Unit*>(w.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (unit) {
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    case 8: run(uint64_t{}); break;
    default: return false;
  }
  return true;
}

bool transposing_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.dim() != 3 || src.sizes() != dst.sizes() || src.scalar_type() != dst.scalar_type() ||
      dst.device() != src.device() || (dst.element_size() != 2 && dst.element_size() != 4)) {
    return false;
  }
  if (dst.numel() == 0) return true;
  if (dst.stride(2) != 1 || src.stride(1) != 1 || dst.size(1) > INT_MAX || dst.size(2) > INT_MAX) return false;
  TransposeShape s;
  s.rows = static_cast<int>(dst.size(1));
  s.cols = static_cast<int>(dst.size(2));
  s.batch = dst.size(0);
  s.src_batch = stride_or_zero(src, 0), s.src_ld = src.stride(2);
  s.dst_batch = stride_or_zero(dst, 0), s.dst_ld = dst.stride(1);
  s.col_tiles = (s.cols + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles = int64_t{s.col_tiles} * ((s.rows + kTransposeTile - 1) / kTransposeTile);
  if (tiles > INT_MAX) return false;
  // The widest access each side's alignment allows: its pointer, its strides and its row length
  // (so no vector straddles a row's end).
  const int64_t unit = dst.element_size();
  const auto widest = [&](const at::Tensor& t, int64_t batch, int64_t ld, int64_t extent) {
    for (int64_t bytes : {int64_t{16}, int64_t{4}}) {
      const int64_t v = bytes / unit;
      if (v > 1 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % bytes == 0 && batch % v == 0 && ld % v == 0 &&
          extent % v == 0) {
        return static_cast<int>(v);
      }
    }
    return 1;
  };
  const int vi = widest(src, s.src_batch, s.src_ld, s.rows), vo = widest(dst, s.dst_batch, s.dst_ld, s.cols);
  const c10::cuda::CUDAGuard guard(dst.device());
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(std::min<int64_t>(s.batch, 65535)));
  const auto run = [&](auto unit_tag) {
    using Unit = decltype(unit_tag);
    with_access_width<Unit>(vi, [&](auto in) {
      with_access_width<Unit>(vo, [&](auto out) {
        transpose_tiles<Unit, decltype(in)::value, decltype(out)::value>
            <<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(static_cast<const Unit*>(src.const_data_ptr()),
                                                                      static_cast<Unit*>(dst.data_ptr()), s);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  };
  unit == 2 ? run(uint16_t{}) : run(uint32_t{});
  return true;
}

bool patchify(const at::Tensor& x5_in, const PatchGeometry& g, bool ones_column,
              const at::Tensor& p) {
  if (g.patch_size() == 0 || g.levels.size() > kMaxLevels) return false;
  const c10::cuda::CUDAGuard guard(p.device());
  if (gather_wide(x5_in, g, ones_column, p)) return true;
  const bool w_contiguous = x5_in.size(4) == 1 || x5_in.stride(4) == 1;
  const bool channels_last = !w_contiguous && x5_in.stride(1) == 1 && x5_in.stride(4) == g.channels;
  // Any other strides: one copy to channels-first.
  const at::Tensor x5 = w_contiguous || channels_last ? x5_in : x5_in.contiguous();
  const int per_unit = channels_last ? 1 : elements_per_unit(x5, p, g);
  const int64_t unit_bytes = x5.element_size() * per_unit;
  Tiling t = base_tiling(x5, p, g, per_unit);
  if (!plan_tiles(t, g, unit_bytes, channels_last, /*gather=*/true, sms())) return false;
  const int64_t blocks = tile_blocks(t, g), smem = smem_bytes(t, unit_bytes);
  // The padding's first element: 1 for a ones column, else 0 (in the low bits of its unit).
  const uint64_t one_bits = ones_column ? one_as_bits(x5.scalar_type()) : 0;
  auto run = [&](auto unit_tag) {
    using Unit = decltype(unit_tag);
    const Unit* x = static_cast<const Unit*>(x5.data_ptr());
    Unit* out = static_cast<Unit*>(p.data_ptr());
    auto kernel = channels_last ? gather_channels_last<Unit> : gather_channels_first<Unit>;
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        x, out, g.patch_size() / per_unit, static_cast<Unit>(one_bits), t);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (unit_bytes) {
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    case 8: run(uint64_t{}); break;
    default: return false;
  }
  return true;
}

bool unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5) {
  if (g.patch_size() == 0 || g.levels.size() > kMaxLevels || !y5.is_contiguous() ||
      q.stride(2) != 1) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(y5.device());
  const int per_unit = elements_per_unit(y5, q, g);
  const int64_t unit_bytes = y5.element_size() * per_unit;
  Tiling t = base_tiling(y5, q, g, per_unit);
  if (!plan_tiles(t, g, unit_bytes, false, /*gather=*/false, sms())) return false;
  const int64_t blocks = tile_blocks(t, g), smem = smem_bytes(t, unit_bytes);
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y5.scalar_type(), "patchgemm_unpatchify", [&] {
    const scalar_t* bias_ptr = bias ? b.const_data_ptr<scalar_t>() : nullptr;
    auto run = [&](auto unit_tag) {
      using Unit = decltype(unit_tag);
      scatter_channels_first<scalar_t, Unit>
          <<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
              static_cast<const Unit*>(q.const_data_ptr()), static_cast<Unit*>(y5.data_ptr()),
              bias_ptr, t);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if constexpr (sizeof(scalar_t) == 2) {
      per_unit == 2 ? run(uint32_t{}) : run(uint16_t{});
    } else if constexpr (sizeof(scalar_t) == 4) {
      run(uint32_t{});
    } else {
      run(uint64_t{});
    }
  });
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
